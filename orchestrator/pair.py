"""The pair check on model directories: the drafter's tokenizer must be the
target's (specd_core/rules/vocab.py says what "the same" means). Run where a pair is
chosen - the orchestrator, and before anything starts in `specd up` and the
local stacks (specd/) - so that a wrong pair is refused with the reason,
not deployed."""

from __future__ import annotations

from specd_core.rules.vocab import SPECIAL, Vocabulary, pair_problem
from specd_core.runtime.head_formats import PUBLISHED, fit_problem, head_format
from specd_core.runtime.models import load_tokenizer


class IncompatiblePair(ValueError):
    """The drafter does not share the target's tokenizer, or a head does not fit the target."""


def vocabulary(tokenizer) -> Vocabulary:
    """A Hugging Face tokenizer as the pair rule sees it."""
    tokens = {i: t for t, i in tokenizer.get_vocab().items()}
    special = {}
    for role in SPECIAL:
        token = getattr(tokenizer, f"{role}_token", None)
        if token is not None:
            special[role] = (getattr(tokenizer, f"{role}_token_id", None), str(token))
    return Vocabulary(tokens, special)


def _load(model_dir: str, label: str):
    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError, TypeError) as exc:
        raise IncompatiblePair(
            f"{label} {model_dir}: cannot load its tokenizer ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
            f"the pair check compares the two tokenizers (a drafter without one can get a copy of the target's)"
        ) from None


def check_pair(target_dir: str, drafter_dir: str | None, target_tokenizer=None) -> None:
    """Raise IncompatiblePair saying what differs when the drafter at
    drafter_dir cannot draft for the target. Nothing to check without a
    drafter. An EAGLE head has no tokenizer (it drafts over the target's own
    vocabulary): a published one is checked to fit the target's shapes instead
    (specd_core/runtime/head_formats.py: fit_problem). target_tokenizer: the
    target's, when already loaded."""
    if not drafter_dir:
        return
    fmt = head_format(drafter_dir)
    if fmt in PUBLISHED:
        from transformers import AutoConfig

        problem = fit_problem(drafter_dir, AutoConfig.from_pretrained(target_dir))
        if problem:
            raise IncompatiblePair(problem)
    if fmt:
        return
    target = target_tokenizer if target_tokenizer is not None else _load(target_dir, "target")
    problem = pair_problem(vocabulary(target), vocabulary(_load(drafter_dir, "drafter")))
    if problem:
        raise IncompatiblePair(
            f"drafter {drafter_dir} cannot draft for target {target_dir}: {problem}; "
            f"a drafter must share the target's tokenizer"
        )

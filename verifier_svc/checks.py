"""The checks of a verify call's inputs: its draft distributions (the sampled-children
rule's q), the feature layers a new session asks for and a resumed session's tokens."""

from __future__ import annotations

from specd_core.errors import InvalidRequest
from specd_core.rules.chain_batch import SparseLaw
from specd_core.rules.tree import TokenTree, children
from specd_core.rules.validation import check_token_ids


def draft_laws(tree: TokenTree, rows: list[tuple[list[int], list[float]]], vocab_size: int) -> list[SparseLaw]:
    """A Verify's draft distributions (one sparse q per row: the root and each
    node), checked; InvalidRequest for a bad one. They stay sparse: a chain's
    rule reads them so (specd_core/rules/chain_batch.py), a tree's makes them
    dense."""
    if len(rows) != len(tree.tokens) + 1:
        raise InvalidRequest(
            f"got {len(rows)} draft distributions for a tree of {len(tree.tokens)} "
            f"nodes (one per row: the root and each node)"
        )
    kids = children(tree)
    used: list[SparseLaw] = []
    for r, (ids, probs) in enumerate(rows):
        if len(ids) != len(probs):
            raise InvalidRequest(f"draft distribution {r}: {len(ids)} ids but {len(probs)} probs")
        if not kids[r]:
            # Childless rows carry nothing, and nothing of them is read: they
            # must not reach a rule either (an id outside the vocabulary there
            # would be an IndexError, i.e. INTERNAL).
            used.append(([], []))
            continue
        check_token_ids(ids, vocab_size, None, f"draft_distributions[{r}].token_ids")
        if any(not (0.0 <= p <= 1.0) for p in probs) or abs(sum(probs) - 1.0) > 1e-3:
            raise InvalidRequest(f"draft distribution {r} is not a probability distribution (sum {sum(probs):.4f})")
        if len(set(ids)) != len(ids):
            # A dense q would keep only one of the repeated entries, so the q
            # the rule uses would not sum to 1.
            raise InvalidRequest(f"draft distribution {r} lists a token id more than once")
        support = set(ids)
        missing = [tree.tokens[c] for c in kids[r] if tree.tokens[c] not in support]
        if missing:
            raise InvalidRequest(f"draft distribution {r} gives probability 0 to drafted token(s) {missing}")
        used.append((list(ids), list(probs)))
    return used


def feature_layers(hidden: bool | tuple[int, ...], layers: int | None) -> tuple[int, ...]:
    """The layer ids whose states a session returns (() = none). hidden: True
    for the last layer's output before the final norm (EAGLE), or layer ids
    (EAGLE-3's auxiliary layers); layers: the lean engine's decoder layers
    (None: the HF engine, which returns no features)."""
    if not hidden:
        return ()
    if layers is None:
        raise InvalidRequest("return_hidden_states needs the verifier's lean engine")
    ids = tuple(hidden) if isinstance(hidden, tuple) else (layers,)
    if any(not 0 <= i <= layers for i in ids):
        raise InvalidRequest(f"hidden_layers {list(ids)} must be decoder layer ids in [0, {layers}]")
    return ids


def check_resume(prompt_ids: list[int], resume: bool, constrained: bool, generated_from: int) -> None:
    """A resumed session's tokens: the prompt and at least one generated token;
    a constrained one's generated_from must say where the generated ones start."""
    if not resume:
        return
    if len(prompt_ids) < 2:
        raise InvalidRequest(
            "a resumed session needs the prompt and at least one generated token "
            f"in prompt_token_ids, got {len(prompt_ids)} token(s)"
        )
    if constrained and not 0 < generated_from < len(prompt_ids):
        raise InvalidRequest(
            f"generated_from {generated_from} must point into the {len(prompt_ids)} prompt_token_ids "
            "of a resumed constrained session (where its generated tokens start)"
        )

"""Whether a drafter may draft for a target: the pair must share a tokenizer.

Pure (plain dicts in, a reason out). The model's embedding rows do not decide
it: checkpoints pad their tables past the tokenizer (Qwen2.5-7B has 152,064
rows, Qwen2.5-0.5B 151,936, both over the same 151,665 tokens), and the
padding rows are no tokens at all. What must agree is what an id MEANS: every
id both tokenizers know names the same token (added tokens included), and the
special tokens both define are the same id and string. Ids only one side knows
are harmless for exactness - the drafter proposes, the target's rule decides
(drafter_svc/vocab.py says how ids past either model's rows are handled).

The pair check only decides whether drafting is meaningful: output is exactly
the target's whatever the drafter proposes, but a drafter whose ids mean other
tokens would be rejected at almost every position while looking deployed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECIAL = ("eos", "bos", "pad", "unk")


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as the check sees it: `tokens` maps id -> token string
    (get_vocab() inverted, added tokens included); `special` maps a role in
    SPECIAL to its (id, token string), for the roles the tokenizer sets."""

    tokens: dict[int, str]
    special: dict[str, tuple[int | None, str]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Ids below this are the tokenizer's (len(tokenizer))."""
        return max(self.tokens, default=-1) + 1


def pair_problem(target: Vocabulary, drafter: Vocabulary, limit: int = 3) -> str | None:
    """None when the drafter's tokenizer is compatible with the target's, else
    what differs: the first `limit` ids (below both sizes) whose tokens differ,
    as (id, target's token, drafter's token), or the special token that differs."""
    common = min(target.size, drafter.size)
    differ = [
        (i, target.tokens.get(i), drafter.tokens.get(i))
        for i in range(common)
        if target.tokens.get(i) != drafter.tokens.get(i)
    ]
    if differ:
        shown = ", ".join(f"id {i}: {t!r} vs {d!r}" for i, t, d in differ[:limit])
        more = f" (and {len(differ) - limit} more)" if len(differ) > limit else ""
        return (
            f"the tokenizers differ on {len(differ)} of the {common} ids both have "
            f"(target's vs drafter's token): {shown}{more}"
        )
    for role in SPECIAL:
        t, d = target.special.get(role), drafter.special.get(role)
        if t is not None and d is not None and t != d:
            return f"the {role} token differs: target's {t[1]!r} (id {t[0]}) vs drafter's {d[1]!r} (id {d[0]})"
    return None

"""Drafting for a target whose embedding rows differ from the drafter's.

Checkpoints pad their embedding and LM-head tables past the tokenizer, by
different amounts (Qwen2.5-7B 152,064 rows, Qwen2.5-0.5B 151,936, over the same
151,665 tokens). The pair check (specd_core/rules/vocab.py) makes sure the ids mean
the same tokens; what is left is the drafter's V_d rows against the target's
V_t, in either direction. Both cases stay lossless:

- V_d > V_t: the drafter must put no mass on ids the target does not have (the
  verifier refuses them). Its logits are cut to the first V_t columns before
  anything is chosen, so its q is softmax over those alone - the drafter's q
  renormalised over the target's ids - and that is the q it samples from and
  sends. The acceptance rules only need the q a draft was really drawn from.
- V_d < V_t: the target may commit an id in [V_d, V_t) (a padding row: trained
  models never emit one, tiny random ones do). The drafter has no embedding for
  it, so its forward sees a substitute id instead (`substitute_id`). Only the
  drafter's own view of the text changes, hence only its proposals; its q is
  still what it sampled from, and the target's extra ids are ordinary tokens
  to the rules (q is 0 there, so they come from the residual / p).

Sessions needing either are wrapped (`PaddedSession`); `PaddedRunner` gives
the batched forwards the same view. Sessions of a pair with equal rows are not
wrapped and run exactly as before.
"""

from __future__ import annotations

import torch

from specd_core.runtime.prefix_cache import publish_prefix, reuse_prefix


def substitute_id(config, rows: int) -> int:
    """What the drafter's forward sees for an id past its rows: its pad, else
    eos, else bos token (a token the model knows carries no content), else 0."""
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None and 0 <= int(value) < rows:
            return int(value)
    return 0


class PaddedSession:
    """A ModelSession whose ids past `rows` are fed as `substitute` and whose
    logits stop at `limit` (the target's rows)."""

    def __init__(self, inner, rows: int, limit: int, substitute: int):
        self.inner, self.rows, self.limit, self.substitute = inner, rows, limit, substitute

    @property
    def length(self) -> int:
        return self.inner.length

    def ids(self, token_ids: list[int]) -> list[int]:
        return [t if t < self.rows else self.substitute for t in token_ids]

    def cut(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., : self.limit] if logits.shape[-1] > self.limit else logits

    def forward(self, token_ids: list[int], last_only: bool = False, positions=None, mask=None) -> torch.Tensor:
        return self.cut(self.inner.forward(self.ids(token_ids), last_only, positions, mask))

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)

    def compact(self, start: int, keep: list[int]) -> None:
        self.inner.compact(start, keep)

    def reserve(self, rows: int, what: str = "a session") -> None:
        self.inner.reserve(rows, what)

    def release(self) -> None:
        self.inner.release()

    def reuse_prefix(self, prompt_rows: list[int], salt: str, limit: int) -> int:
        # Named by the ids fed to the model, which decide the rows.
        return reuse_prefix(self.inner, self.ids(prompt_rows), salt, limit)

    def publish_prefix(self) -> None:
        publish_prefix(self.inner)


class PaddedRunner:
    """A runner's batched forward as the drafting code uses it: padded sessions
    go to the model as their inner session with substituted ids, and each one's
    logits come back cut to its limit."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def engine(self) -> str:
        return self.inner.engine

    @property
    def lean(self):
        return self.inner.lean

    def new_session(self):
        return self.inner.new_session()

    def forward_batch(self, items: list, last_only=False) -> list[torch.Tensor]:
        plain = [
            (c.inner, c.ids(ids), p, m) if isinstance(c, PaddedSession) else (c, ids, p, m) for c, ids, p, m in items
        ]
        out = self.inner.forward_batch(plain, last_only)
        return [c.cut(o) if isinstance(c, PaddedSession) else o for (c, *_), o in zip(items, out)]

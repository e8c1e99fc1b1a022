"""RoPE cos/sin for the lean engine (specd/runtime/lean.py), as Hugging Face computes them.

The inverse frequencies and the attention scaling come from transformers itself
(`ROPE_INIT_FUNCTIONS[rope_type]`, or the model's own rotary class for "default"),
so every variant its configs name - default, linear, dynamic, llama3, yarn,
longrope - is HF's formula, not a re-derivation. cos/sin are
`(position * inv_freq).cos() * attention_scaling` in float32, cast to the model
dtype: HF's arithmetic, element by element.

Static variants (default, linear, llama3, yarn) keep a table over positions that
grows by doubling. Two variants depend on the sequence length, which HF takes
as max(position) + 1 of each call (`dynamic_rope_update`):

* longrope (Phi-3.5): the short factors while that length is at most
  original_max_position_embeddings, else the long ones - two tables.
* dynamic (NTK): the original frequencies up to max_position_embeddings, past it
  frequencies recomputed for that length - computed on the fly for such items.

Here the length is each item's own (max of its positions + 1), so a forward is a
pure function of each session's positions, also inside a batch. For a sequence
that grows (prefill, then decode steps) that is exactly HF's choice. HF's
version is stateful and shared by all sessions of the model: dynamic keeps the
largest length it has seen (`max_seq_len_cached`) until a call is shorter than
max_position_embeddings, so after a rollback - or after another session went
longer - HF would rotate new rows with a longer length's frequencies than the
positions alone say. Rows already cached keep the frequencies they were rotated
with, in both - so in both, past the switch, logits depend on how the sequence was
split into calls (a k-row verify rotates every row with its last position's length,
plain decoding each row with its own).
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

STATIC = {"default", "linear", "llama3", "yarn"}
SEQUENCE_DEPENDENT = {"dynamic", "longrope"}
SUPPORTED = STATIC | SEQUENCE_DEPENDENT


def rope_params(config, layer_type: str | None) -> dict:
    """The RoPE parameters of a config, or of one layer type (Gemma-3)."""
    params = config.rope_parameters
    return params[layer_type] if layer_type is not None else params


class Rope:
    """cos/sin of one set of RoPE parameters (one per layer type where they differ)."""

    INITIAL_ROWS = 4096

    def __init__(self, config, rotary_cls, layer_type: str | None, device, dtype):
        self.config = config
        self.layer_type = layer_type
        self.device, self.dtype = device, dtype
        params = rope_params(config, layer_type)
        self.rope_type = params.get("rope_type", "default")
        self._kw = {"layer_type": layer_type} if layer_type is not None else {}
        if self.rope_type == "default":
            # Each model defines its own default (Phi-3's honours partial_rotary_factor, Llama's does not).
            init = rotary_cls.compute_default_rope_parameters
        else:
            init = ROPE_INIT_FUNCTIONS[self.rope_type]
        self._init = init
        inv_freq, self.scaling = init(config, **self._kw)  # as HF's rotary module at load time
        self.rotary_dim = 2 * inv_freq.shape[0]
        self._inv = {"short": inv_freq.float()}
        if self.rope_type == "longrope":
            self.switch_at = params["original_max_position_embeddings"]
            long_inv, _ = init(config, seq_len=self.switch_at + 1, **self._kw)
            self._inv["long"] = long_inv.float()
        elif self.rope_type == "dynamic":
            self.switch_at = config.max_position_embeddings
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows = 0
        self._grow(min(self.INITIAL_ROWS, config.max_position_embeddings))

    def _cos_sin(self, pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos[:, None].float() * inv_freq.to(self.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(self.dtype), (emb.sin() * self.scaling).to(self.dtype)

    def _grow(self, rows: int) -> None:
        rows = max(rows, 2 * self._rows)
        pos = torch.arange(rows, device=self.device)
        self._tables = {name: self._cos_sin(pos, inv) for name, inv in self._inv.items()}
        self._rows = rows

    def cos_sin(self, items: list[tuple[torch.Tensor, int, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (R, rotary_dim) for every row of a forward. items: per
        session (positions (n,), end = its cache length after the forward,
        whether the positions are the default ones start..end-1); every
        position is below end (a row never sits past its own cache row)."""
        top = max(end for _, end, _ in items)
        if top > self._rows:
            self._grow(top)
        if self.rope_type in STATIC:
            cos, sin = self._tables["short"]
            pos = items[0][0] if len(items) == 1 else torch.cat([p for p, _, _ in items])
            return cos[pos], sin[pos]
        parts = [self._item(pos, end, default) for pos, end, default in items]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def _item(self, pos: torch.Tensor, end: int, default: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One item's cos/sin for a sequence-dependent variant. With default
        positions the length is `end`, a host int; with given positions it is
        decided on the device (torch.where), without a sync."""
        short_cos, short_sin = self._tables["short"]
        if self.rope_type == "longrope":
            long_cos, long_sin = self._tables["long"]
            if default:
                cos, sin = self._tables["long" if end > self.switch_at else "short"]
                return cos[pos], sin[pos]
            use_long = pos.max() + 1 > self.switch_at
            return torch.where(use_long, long_cos[pos], short_cos[pos]), torch.where(
                use_long, long_sin[pos], short_sin[pos]
            )
        # dynamic: HF passes the length as a 0-dim int64 tensor; so does this, for the same float arithmetic.
        if default:
            if end <= self.switch_at:
                return short_cos[pos], short_sin[pos]
            inv, _ = self._init(self.config, self.device, seq_len=torch.tensor(end, device=self.device), **self._kw)
            return self._cos_sin(pos, inv)
        seq_len = pos.max() + 1
        inv, _ = self._init(self.config, self.device, seq_len=seq_len, **self._kw)
        cos, sin = self._cos_sin(pos, inv)
        longer = seq_len > self.switch_at
        return torch.where(longer, cos, short_cos[pos]), torch.where(longer, sin, short_sin[pos])

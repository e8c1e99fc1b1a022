"""RoPE cos/sin for the lean engine (specd_core/runtime/lean.py), as Hugging Face computes them.

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
  frequencies recomputed for that length.

So in HF, past the switch, the logits depend on how a sequence is split into
calls: a k-row call rotates all its rows with its last row's length, plain
decoding (a prefill, then one token per call) each row with its own. What
specd must reproduce is the target alone, i.e. plain decoding. So here a
session's first call (its prefill: HF's generate prefills the prompt in one
call too) takes the length of the call for all its rows, and every later call
rotates each row with its own length, position + 1 - what that row would have
had as a decode step of its own. A verify of k draft rows, a tree's nodes (at
their depths' positions) or a drafter's chain therefore carry exactly the
rotations of plain decoding along each path. Rows already cached keep the
rotation they were made with, as in HF. Everything is a pure function of each
session's positions, also inside a batch (HF's rotary state is shared by all
sessions of a model, and grows with the longest one).
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

    def cos_sin(
        self, positions: torch.Tensor, spans: list[tuple[int, int, bool]], top: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (R, rotary_dim) for every row of a forward. positions:
        (R,) on the device; spans: per session in row order (its cache length
        before the forward, after it, whether its positions are the default
        ones start..end-1); top: the largest end. Every position is below its
        session's end (a row never sits past its own cache row)."""
        if top > self._rows:
            self._grow(top)
        if self.rope_type in STATIC:
            cos, sin = self._tables["short"]
            return cos[positions], sin[positions]
        parts, r0 = [], 0
        for start, end, default in spans:
            parts.append(self._item(positions[r0 : r0 + end - start], start, end, default))
            r0 += end - start
        if len(parts) == 1:
            return parts[0]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def _item(self, pos: torch.Tensor, start: int, end: int, default: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One item's cos/sin for a sequence-dependent variant (see the module
        docstring): a prefill (start 0) with the call's length, a later call
        with each row's own."""
        short_cos, short_sin = self._tables["short"]
        if end <= self.switch_at:  # every length involved is at most end: the original frequencies
            return short_cos[pos], short_sin[pos]
        if self.rope_type == "longrope":
            long_cos, long_sin = self._tables["long"]
            if start == 0:
                return long_cos[pos], long_sin[pos]  # the call's length is end, past the switch
            use_long = (pos + 1 > self.switch_at)[:, None]  # per row, on the device
            return torch.where(use_long, long_cos[pos], short_cos[pos]), torch.where(
                use_long, long_sin[pos], short_sin[pos]
            )
        # dynamic: frequencies per length past the switch; HF passes the length
        # as a 0-dim int64 tensor, and so does this, for the same float arithmetic.
        if start == 0:
            return self._dynamic(pos, end)
        # Per row. Positions of a tree come as a tensor: read them once (a
        # host sync on a GPU, only for sessions past the switch).
        rows = list(range(start, end)) if default else pos.tolist()
        parts = [
            self._dynamic(pos[i : i + 1], p + 1)
            if p + 1 > self.switch_at
            else (short_cos[pos[i : i + 1]], short_sin[pos[i : i + 1]])
            for i, p in enumerate(rows)
        ]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def _dynamic(self, pos: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv, _ = self._init(self.config, self.device, seq_len=torch.tensor(length, device=self.device), **self._kw)
        return self._cos_sin(pos, inv)

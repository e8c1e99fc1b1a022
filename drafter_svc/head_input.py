"""How each head format turns (token, feature) into its layer's input rows,
and its logits into a distribution over the target's ids: the only places
where specd's own EAGLE head, the published EAGLE-1/2 heads and the EAGLE-3
heads differ once built (specd_core/runtime/head_formats.py describes them).
drafter_svc/eagle.py's HeadRunner drafts with any of them.

Every head's KV row i is the pair (x_{i+1}, f_i). A committed row's f_i comes
from the verifier (`committed` maps it into the head's own feature space); a
drafted row's f_i is the head's own output at its parent, already in that
space (what the method prescribes: EAGLE's autoregression on features, and
EAGLE-3's reuse of its layer's output before `norm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specd_core.runtime.lean import LeanModel


class FusedInput:
    """EAGLE-1/2 (and specd's head): the layer reads fc([embed(x); f]).

    feature_norm: published EAGLE-1/2 heads read the target's last hidden
    state after its final norm; the verifier sends it before the norm (what
    specd's own head reads), so the drafter applies the target's norm here."""

    def __init__(self, fc: torch.Tensor, bias: torch.Tensor | None = None, feature_norm=None, eps: float = 1e-6):
        self.fc, self.bias = fc, bias  # (C, 2C), (C,)
        self.feature_norm, self.eps = feature_norm, eps
        self.hidden_size = fc.shape[0]  # the head's own features
        self.feature_width = fc.shape[1] - fc.shape[0]  # what the verifier sends per token

    def lean_of(self, runner) -> LeanModel:
        """The lean model the head runs on, from the drafter core's runner."""
        return runner.lean

    def committed(self, feats: torch.Tensor) -> torch.Tensor:
        if self.feature_norm is None:
            return feats
        x32 = feats.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(feats.dtype) * self.feature_norm

    def rows(self, lean: LeanModel, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.cat([lean.embed[ids], feats.to(lean.dtype)], -1), self.fc, self.bias)  # (R, C)

    def to_target(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        return logits


class Eagle3Lean(LeanModel):
    """The one-layer lean model of an EAGLE-3 head: its q/k/v projections read
    [input_layernorm(embed(x)); hidden_norm(h)] (2C wide) while the residual
    stream is h alone. `side` holds the step's token embeddings, row for row
    with h (set by Eagle3Input.rows just before the forward, under the core's
    lock). A CUDA graph would keep the `side` of its capture, so its steps
    run without (specd_core/runtime/step_graphs.py)."""

    graphable = False

    def __init__(self, hf_model, hidden_norm: torch.Tensor):
        super().__init__(hf_model)
        self.hidden_norm = hidden_norm
        self.side: torch.Tensor | None = None

    def _attn_input(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        assert self.side is not None and self.side.shape[0] == x.shape[0]
        return torch.cat([self._rms(self.side, L["ln1"]), self._rms(x, self.hidden_norm)], -1)


class Eagle3Input:
    """EAGLE-3: committed rows read fc(the auxiliary layers' states, 3 x target
    hidden), drafted rows the head's own output; logits over the draft
    vocabulary land on target ids draft_id + d2t[draft_id] (-inf elsewhere,
    so q gives the ids the head cannot produce no mass)."""

    def __init__(self, fc: torch.Tensor, hidden_norm: torch.Tensor, target_ids: torch.Tensor, vocab_size: int):
        self.fc, self.hidden_norm = fc, hidden_norm  # (C, 3 C_target), (C,)
        self.target_ids, self.vocab_size = target_ids, vocab_size  # (draft vocab,), the target's rows
        self.hidden_size = fc.shape[0]
        self.feature_width = fc.shape[1]

    def lean_of(self, runner) -> LeanModel:
        return Eagle3Lean(runner.model, self.hidden_norm)

    def committed(self, feats: torch.Tensor) -> torch.Tensor:
        return F.linear(feats.to(self.fc.dtype), self.fc)

    def rows(self, lean: LeanModel, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        assert isinstance(lean, Eagle3Lean)
        lean.side = lean.embed[ids]
        return feats.to(lean.dtype)

    def to_target(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for lg in logits:
            full = lg.new_full((lg.shape[0], self.vocab_size), float("-inf"))
            full[:, self.target_ids] = lg
            out.append(full)
        return out

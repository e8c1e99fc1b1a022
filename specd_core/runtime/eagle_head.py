"""An EAGLE-style draft head (Li et al. 2024, "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty"): the reference torch module, its
config, saving and loading.

The head drafts from the TARGET's own features instead of from tokens alone:
at position t it reads [embed(x_{t+1}); f_t] - the next token's embedding and
the target's last-layer hidden state (before the final norm) at x_t - fuses
them with one linear layer and runs ONE Llama decoder layer over the sequence.
Its output f^_{t+1} is a prediction of the target's feature at x_{t+1}; the
target's own final norm and LM head turn it into a distribution over x_{t+2}.
Deeper drafts feed the head's predicted features back in (autoregression on
features, EAGLE section 3). Feeding the token as well as the feature resolves
the sampling uncertainty a feature alone leaves (which token was drawn).

The embedding, final norm and LM head are the target's (frozen, loaded from the
target directory), so the head ships only fc + one layer (~0.9 M parameters
for the demo target, fp16 on disk).

Parameter names follow Hugging Face's Llama layer (`layer.self_attn.q_proj`,
...), so the serving side can build a one-layer Llama around them and reuse the
lean forward (drafter_svc/eagle.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
KIND = "specd-eagle-head"


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    # Which target feature the head reads: the last decoder layer's output,
    # before the final norm (EAGLE's "second-to-top layer" feature).
    feature: str = "last_hidden_prenorm"

    @classmethod
    def from_target(cls, cfg) -> HeadConfig:
        """The head's layer has the target's layer dimensions."""
        return cls(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            cfg.intermediate_size,
            cfg.vocab_size,
            cfg.rms_norm_eps,
            cfg.rope_parameters["rope_theta"],
            cfg.max_position_embeddings,
        )


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x: (B, H, T, d), pos: (T,) -> x rotated (Llama's rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device=x.device) / d))
    freqs = torch.outer(pos.float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, pos, past=None, mask=None):  # x: (B, T, C)
        """past: (k, v) of earlier rows to attend to besides these; mask: bool
        (T, past + T), True = attend (default: causal, no past). Returns
        (output, (k, v) of past + these rows)."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=c.num_attention_heads != c.num_key_value_heads
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1)), (k, v)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.mlp = _MLP(c)

    def forward(self, x, pos, past=None, mask=None):
        a, kv = self.self_attn(rms_norm(x, self.input_layernorm, self.c.rms_norm_eps), pos, past, mask)
        x = x + a
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, self.c.rms_norm_eps)), kv


class EagleHead(nn.Module):
    """The trainable part: fc([emb; feature]) -> one decoder layer -> feature."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.layer = _Layer(c)

    def forward(self, tok_emb: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """tok_emb, feats: (B, T, C) = embed(x_{t+1}), f_t; causal over T.
        Returns the predicted features f^_{t+1}, (B, T, C)."""
        if pos is None:
            pos = torch.arange(tok_emb.shape[1], device=tok_emb.device)
        return self.forward_rows(tok_emb, feats, pos)[0]

    def forward_rows(self, tok_emb, feats, pos, past=None, mask=None):
        """Rows attending to `past` (k, v) under `mask` (see _Attention);
        returns (predicted features, (k, v) including these rows)."""
        return self.layer(self.fc(torch.cat([tok_emb, feats], -1)), pos, past, mask)


@dataclass
class TargetParts:
    """The target's frozen pieces the head shares: embedding, final norm, LM head."""

    embed: torch.Tensor  # (V, C)
    norm: torch.Tensor  # (C,)
    lm_head: torch.Tensor  # (V, C)
    eps: float

    @classmethod
    def of(cls, hf_model) -> TargetParts:
        return cls(
            hf_model.model.embed_tokens.weight,
            hf_model.model.norm.weight,
            hf_model.lm_head.weight,
            hf_model.config.rms_norm_eps,
        )

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(feats, self.norm, self.eps), self.lm_head)


def save_head(head: EagleHead, out: Path, extra: dict | None = None) -> None:
    """config.json + model.safetensors (fp16): only the head's own weights."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = {"kind": KIND, **asdict(head.config), "torch_dtype": "float16", **(extra or {})}
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(
        {k: v.detach().to(torch.float16).contiguous() for k, v in head.state_dict().items()}, str(out / WEIGHTS_NAME)
    )


def is_head_dir(path) -> bool:
    p = Path(path) / CONFIG_NAME
    return p.exists() and json.loads(p.read_text()).get("kind") == KIND


def load_head(path, dtype=torch.float32) -> EagleHead:
    from safetensors.torch import load_file

    raw = json.loads((Path(path) / CONFIG_NAME).read_text())
    if raw.get("kind") != KIND:
        raise ValueError(f"{path} is not an EAGLE head directory (config.json kind {raw.get('kind')!r})")
    fields = HeadConfig.__dataclass_fields__
    head = EagleHead(HeadConfig(**{k: v for k, v in raw.items() if k in fields}))
    head.load_state_dict(load_file(str(Path(path) / WEIGHTS_NAME)))
    return head.to(dtype).eval()

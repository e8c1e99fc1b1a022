"""Train an EAGLE-3 draft head (Li et al. 2025) for the demo target and save it
in the published format (specd_core/runtime/head_formats.py, format eagle3),
served with `--method eagle3`:

    python -m training.eagle3 --target models/demo/target --out models/demo/eagle3 --minutes 30

The head: fc (hidden x 3 target hidden) over the target's auxiliary layers'
states (the published default (2, L // 2, L - 3), recorded in the config); one
decoder layer `midlayer` whose attention reads [input_layernorm(embed(x));
hidden_norm(h)] while its residual stream is h; `norm` and `lm_head` over a
draft vocabulary of the target's most frequent tokens in the training split
(d2t: draft id -> target id offset, t2d: mask over the target's ids), as the
published heads choose theirs. No embedding is saved: the drafter takes the
target's.

Row t reads (x_{t+1}, h_t) and predicts the target's distribution after x_{t+1}
restricted to the draft vocabulary (soft labels; EAGLE-3 drops EAGLE's feature
regression). Training-time test: the draft is unrolled `--levels` deep, level d
reading the head's own level d-1 outputs under the attention a depth-d draft
node has (training/eagle.py: unroll_masks), so deeper drafts run on the inputs
they see when serving.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import save_file

from specd_core.runtime.eagle_head import _MLP, HeadConfig, _Attention, rms_norm
from specd_core.runtime.head_formats import EAGLE3_ARCH, aux_layer_ids

from .eagle import unroll_masks
from .head_training import (
    Budget,
    Frozen,
    Setup,
    head_parser,
    parse_and_seed,
    relative_target,
    setup,
    soft_ce,
    train_loop,
)


class Eagle3Head(nn.Module):
    def __init__(self, c: HeadConfig, target_hidden: int, draft_vocab: int):
        super().__init__()
        self.c = c
        h = c.hidden_size
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.self_attn = _Attention(c)
        # The attention reads the embedding and the hidden state side by side.
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * h, old.out_features, bias=False))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.mlp = _MLP(c)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)

    def rows(self, emb, h, pos, past=None, mask=None):
        """Rows (embed(x), h) -> (the layer's outputs before `norm`, (k, v))."""
        eps = self.c.rms_norm_eps
        attn_in = torch.cat([rms_norm(emb, self.input_layernorm, eps), rms_norm(h, self.hidden_norm, eps)], -1)
        a, kv = self.self_attn(attn_in, pos, past, mask)
        h = h + a
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, eps)), kv

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(out, self.norm, self.c.rms_norm_eps))

    def published(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the published names."""
        w = {"fc.weight": self.fc.weight, "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight}
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            w[f"midlayer.{n}.weight"] = getattr(self, n)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[f"midlayer.self_attn.{n}.weight"] = getattr(self.self_attn, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            w[f"midlayer.mlp.{n}.weight"] = getattr(self.mlp, n).weight
        return w


def draft_vocabulary(train_ids: np.ndarray, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target ids of the training split, in id order."""
    counts = np.bincount(train_ids, minlength=vocab)
    return torch.sort(torch.from_numpy(np.argsort(-counts, kind="stable")[:size].copy())).values


def head_loss(head: Eagle3Head, embed: torch.Tensor, aux: list[int], draft_ids: torch.Tensor,
              x: torch.Tensor, f: Frozen, levels: int) -> tuple[torch.Tensor, dict]:
    rows = x.shape[1] - levels
    masks = unroll_masks(rows, levels)
    h = head.fc(torch.cat([f.hidden[i][:, :rows] for i in aux], -1))
    past, total, m = None, 0.0, {}
    for d in range(levels):
        pos = torch.arange(d, d + rows)
        out, past = head.rows(embed[x[:, 1 + d : 1 + d + rows]], h, pos, past, None if d == 0 else masks[d])
        ce, top1 = soft_ce(head.logits(out), f.logits[:, 1 + d : 1 + d + rows][..., draft_ids])
        total = total + ce / levels
        m[f"ce{d + 1}"], m[f"top1_{d + 1}"] = ce.item(), top1.item()
        h = out  # the next level reads the head's own output, as drafting does
    return total, m


def save(head: Eagle3Head, out: Path, draft_ids: torch.Tensor, vocab: int, aux: list[int], extra: dict) -> None:
    c = head.c
    out.mkdir(parents=True, exist_ok=True)
    w = {k: v.detach().to(torch.float16).contiguous() for k, v in head.published().items()}
    w["d2t"] = draft_ids - torch.arange(len(draft_ids))  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    w["t2d"] = t2d
    save_file(w, str(out / "model.safetensors"))
    cfg = {
        "architectures": [EAGLE3_ARCH], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
        "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": len(draft_ids),
        "target_hidden_size": head.fc.in_features // 3, "torch_dtype": "float16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}, **extra,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main(argv=None) -> None:
    ap = head_parser(__doc__, "models/demo/eagle3", 3e-3)
    ap.add_argument("--draft-vocab", type=int, default=3072)
    ap.add_argument("--levels", type=int, default=3, help="unrolled draft depths trained (training-time test)")
    a = parse_and_seed(ap, argv)
    s: Setup = setup(a.target, a.seq_len, "eagle3")
    tc = s.target.config
    vocab, aux = tc.vocab_size, list(aux_layer_ids({}, tc.num_hidden_layers))
    draft_ids = draft_vocabulary(s.train_ids, vocab, a.draft_vocab)
    covered = np.isin(s.train_ids, draft_ids.numpy()).mean()
    head = Eagle3Head(HeadConfig.from_target(tc), tc.hidden_size, len(draft_ids))
    for p in head.parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
    embed = s.target.model.embed_tokens.weight.detach()
    print(f"[eagle3] aux layers {aux}, draft vocabulary {len(draft_ids)} of {vocab} "
          f"({covered:.1%} of training tokens), head params {sum(p.numel() for p in head.parameters()):,}", flush=True)
    rng = np.random.default_rng(a.seed)
    extra = {"target": relative_target(a.target, a.out)}

    def step_loss(_step):
        x = s.batch(rng, a.batch, a.seq_len)
        return head_loss(head, embed, aux, draft_ids, x, s.run(x), a.levels)

    @torch.no_grad()
    def evaluate() -> dict:
        head.eval()
        _, m = head_loss(head, embed, aux, draft_ids, s.heldout, s.run(s.heldout), a.levels)
        head.train()
        return m

    record = train_loop(list(head.parameters()), Budget(a.minutes, a.steps, a.lr), step_loss, evaluate,
                        lambda info: save(head, a.out, draft_ids, vocab, aux, {**extra, **info}), "eagle3")
    save(head, a.out, draft_ids, vocab, aux, extra)
    record.update(draft_vocab_coverage=float(covered), args={k: str(v) if isinstance(v, Path) else v
                                                             for k, v in vars(a).items()})
    (a.out / "train_info.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

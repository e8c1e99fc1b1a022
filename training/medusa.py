"""Train Medusa heads (Cai et al. 2024) for the demo target and save them in the
Medusa authors' layout (specd_core/runtime/medusa_format.py), served with
`--method medusa`:

    python -m training.medusa --target models/demo/target --out models/demo/medusa --minutes 30

Head i reads the target's last hidden state after its final norm at position t
and predicts the token at t + 2 + i: `--layers` residual blocks x + SiLU(W x + b)
and its own LM head. As in Medusa, the blocks start at W = 0 (identity) and
every LM head starts as a copy of the target's, so training starts from "the
next token again" rather than from noise. The target stays frozen (Medusa-1)
and the heads are distilled towards its own distributions at t + 1 + i (soft
labels, Medusa's self-distillation), head i's loss weighted 0.8^i as in the
Medusa authors' recipe.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

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

DECAY = 0.8


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, lm_head: torch.Tensor, heads: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers)) for _ in range(heads)
        )
        for block in self.blocks:
            for lin in block:
                nn.init.zeros_(lin.weight)
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, lm_head.shape[0], bias=False) for _ in range(heads))
        with torch.no_grad():
            for lm in self.lm_heads:
                lm.weight.copy_(lm_head)

    def logits(self, i: int, h: torch.Tensor) -> torch.Tensor:
        for lin in self.blocks[i]:
            h = h + F.silu(lin(h))
        return self.lm_heads[i](h)

    def published(self) -> dict[str, torch.Tensor]:
        """The original layout's names: medusa_head.{i}.{j}.linear.* for block j,
        medusa_head.{i}.{layers}.weight for the LM head."""
        w = {}
        for i, (block, lm) in enumerate(zip(self.blocks, self.lm_heads)):
            for j, lin in enumerate(block):
                w[f"medusa_head.{i}.{j}.linear.weight"] = lin.weight
                w[f"medusa_head.{i}.{j}.linear.bias"] = lin.bias
            w[f"medusa_head.{i}.{len(block)}.weight"] = lm.weight
        return w


def heads_loss(m: MedusaHeads, f: Frozen) -> tuple[torch.Tensor, dict]:
    k = len(m.lm_heads)
    rows = f.logits.shape[1] - k
    h = f.hidden[-1][:, :rows]  # after the final norm
    total, out = 0.0, {}
    for i in range(k):
        ce, top1 = soft_ce(m.logits(i, h), f.logits[:, 1 + i : 1 + i + rows])
        total = total + DECAY**i * ce
        out[f"ce{i}"], out[f"top1_{i}"] = ce.item(), top1.item()
    return total / sum(DECAY**i for i in range(k)), out


def save(m: MedusaHeads, out: Path, hidden: int, vocab: int, extra: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in m.published().items()},
              str(out / "medusa_lm_head.safetensors"))
    cfg = {"medusa_num_heads": len(m.lm_heads), "medusa_num_layers": len(m.blocks[0]),
           "hidden_size": hidden, "vocab_size": vocab, **extra}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main(argv=None) -> None:
    ap = head_parser(__doc__, "models/demo/medusa", 1e-3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=1)
    a = parse_and_seed(ap, argv)
    s: Setup = setup(a.target, a.seq_len, "medusa")
    tc = s.target.config
    heads = MedusaHeads(tc.hidden_size, s.target.lm_head.weight.detach(), a.heads, a.layers)
    print(f"[medusa] {a.heads} heads x {a.layers} layers, params {sum(p.numel() for p in heads.parameters()):,}",
          flush=True)
    rng = np.random.default_rng(a.seed)
    rel = relative_target(a.target, a.out)
    extra = {"base_model_name_or_path": rel, "target": rel}

    @torch.no_grad()
    def evaluate() -> dict:
        return heads_loss(heads, s.run(s.heldout))[1]

    record = train_loop(list(heads.parameters()), Budget(a.minutes, a.steps, a.lr),
                        lambda _: heads_loss(heads, s.run(s.batch(rng, a.batch, a.seq_len))), evaluate,
                        lambda info: save(heads, a.out, tc.hidden_size, tc.vocab_size, {**extra, **info}), "medusa")
    save(heads, a.out, tc.hidden_size, tc.vocab_size, extra)
    record["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    (a.out / "train_info.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

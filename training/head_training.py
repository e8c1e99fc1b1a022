"""What the draft-head trainers share (training/eagle3.py, training/medusa.py):
the frozen demo target and its outputs over a window, the corpus' training and
held-out windows, and a wall-clock-budgeted optimisation loop.

The target runs once per step without gradients and gives, for the whole
window, Hugging Face's hidden states (index i: the residual stream entering
decoder layer i; the last: after the final norm) and its logits, so each head
is distilled towards the target's own next-token distributions (what it must
match for drafts to be accepted), never the corpus' tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import corpus
from .eagle import heldout_ids, heldout_windows


@dataclass
class Frozen:
    """The target's outputs over a batch of windows."""

    hidden: tuple[torch.Tensor, ...]  # (B, T, C) each, len = layers + 1
    logits: torch.Tensor  # (B, T, V)


@dataclass
class Setup:
    target: torch.nn.Module
    train_ids: np.ndarray
    heldout: torch.Tensor  # (n, T) evaluation windows, never trained on

    @torch.no_grad()
    def run(self, x: torch.Tensor) -> Frozen:
        out = self.target(input_ids=x, output_hidden_states=True)
        return Frozen(tuple(out.hidden_states), out.logits.float())

    def batch(self, rng: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
        starts = rng.integers(0, len(self.train_ids) - seq_len, batch)
        return torch.from_numpy(np.stack([self.train_ids[s : s + seq_len] for s in starts]).astype(np.int64))


def setup(target_dir: Path, seq_len: int, tag: str) -> Setup:
    """The frozen fp32 target, the TRAIN split's ids and the held-out windows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(target_dir)
    train_ids = corpus.encode_files(tok, corpus.split_files()["train"])
    held = heldout_ids(tok)
    print(f"[{tag}] train tokens {len(train_ids):,}, held-out {len(held):,} ({time.time() - t0:.0f} s)", flush=True)
    return Setup(target, train_ids, heldout_windows(held, seq_len))


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of a head's logits to the target's distribution (soft
    labels), and top-1 agreement with the target's argmax."""
    p = torch.softmax(target_logits, -1)
    logp = torch.log_softmax(logits.float(), -1)
    return -(p * logp).sum(-1).mean(), (logp.argmax(-1) == p.argmax(-1)).float().mean()


@dataclass
class Budget:
    minutes: float
    steps: int = 0  # fixed steps instead of minutes (smoke runs)
    lr: float = 3e-3
    warmup: int = 30


def train_loop(
    params: list[torch.nn.Parameter],
    budget: Budget,
    step_loss: Callable[[int], tuple[torch.Tensor, dict]],
    evaluate: Callable[[], dict],
    checkpoint: Callable[[dict], None],
    tag: str,
    eval_every: int = 300,
) -> dict:
    """AdamW under a cosine learning rate that follows elapsed / budget (like
    training/train.py), gradient clipping at 1; evaluates and checkpoints every
    eval_every steps and at the end. Returns the run's record."""
    opt = torch.optim.AdamW(params, lr=budget.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, step, ema, history = time.time(), 0, None, []

    def progress() -> float:
        return step / budget.steps if budget.steps else (time.time() - start) / (budget.minutes * 60)

    while progress() < 1.0:
        p = min(1.0, progress())
        lr = budget.lr * min(1.0, (step + 1) / budget.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, m = step_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 20 == 0:
            shown = " ".join(f"{k} {v:.3f}" for k, v in m.items())
            print(f"step {step} loss {loss.item():.4f} ema {ema:.4f} {shown} lr {lr:.2e} "
                  f"{(time.time() - start) / 60:.1f} min", flush=True)
        if step % eval_every == 0:
            r = dict(evaluate(), step=step, minutes=(time.time() - start) / 60)
            history.append(r)
            print(f"[{tag} eval] " + json.dumps(r), flush=True)
            checkpoint({"training": "in progress", "step": step})
    final = evaluate()
    print(f"[{tag} final] " + json.dumps(final), flush=True)
    return {"steps": step, "minutes": (time.time() - start) / 60, "train_loss_ema": ema,
            "final_heldout": final, "history": history, "torch": torch.__version__}


def head_parser(doc: str, out: str, lr: float) -> argparse.ArgumentParser:
    """The flags every head trainer takes (the data, the budget, the
    optimiser, the machine); a trainer adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("models/demo/target"))
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=0, help="fixed steps instead of --minutes (smoke runs)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def parse_and_seed(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    return a


def relative_target(target_dir: Path, out: Path) -> str:
    """Where the head's directory finds its target (recorded, as published heads
    name their base model)."""
    return os.path.relpath(target_dir.resolve(), out.resolve())

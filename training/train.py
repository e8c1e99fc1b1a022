"""Training loops: plain LM training for the target, on-the-fly distillation for
the drafter.

Both loops run either for a fixed number of steps (exactly reproducible) or for
a wall-clock budget (the LR schedule then follows elapsed/budget, so a slow or
shared CPU still ends on a fully decayed LR instead of being cut mid-schedule).
The number of steps actually taken is logged and put in the model card, so a
time-budgeted run can be replayed exactly with the steps argument.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class TrainArgs:
    seq_len: int = 256
    batch: int = 16
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    steps: int | None = None  # fixed step count, or...
    minutes: float | None = None  # ...a wall-clock budget
    log_every: int = 10
    eval_every_min: float = 10.0
    ckpt_every_min: float = 5.0
    seed: int = 0
    # distillation only
    kd_temperature: float = 1.0
    kd_alpha: float = 0.9  # weight of the KL term; (1 - alpha) goes to corpus CE


class Batches:
    """Random windows of the token stream (seeded, so the sequence is replayable)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, seed: int):
        self.tokens, self.seq_len, self.batch = tokens, seq_len, batch
        self.rng = np.random.default_rng(seed)

    def next(self) -> torch.Tensor:
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch)
        rows = [self.tokens[s : s + self.seq_len + 1] for s in starts]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def heldout_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Fixed, evenly spaced, non-overlapping windows for held-out losses."""
    n = min(max_windows, (len(tokens) - 1) // (seq_len + 1))
    stride = (len(tokens) - 1) // n
    rows = [tokens[i * stride : i * stride + seq_len + 1] for i in range(n)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate_ce(model, windows: torch.Tensor, bs: int = 16) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(windows), bs):
        chunk = windows[i : i + bs]
        total += lm_loss(model, chunk).item() * len(chunk)
    model.train()
    return total / len(windows)


@torch.no_grad()
def evaluate_kd(student, teacher, windows: torch.Tensor, bs: int = 16) -> dict:
    """Held-out CE of the student and KL(teacher || student) at T=1, per token."""
    student.eval()
    ce = kl = 0.0
    for i in range(0, len(windows), bs):
        x = windows[i : i + bs]
        s = student(input_ids=x[:, :-1]).logits.float()
        t = teacher(input_ids=x[:, :-1]).logits.float()
        ce += F.cross_entropy(s.reshape(-1, s.size(-1)), x[:, 1:].reshape(-1)).item() * len(x)
        kl += _kl(t, s, 1.0).item() * len(x)
    student.train()
    return {"ce": ce / len(windows), "kl": kl / len(windows)}


def _kl(teacher_logits, student_logits, tau: float) -> torch.Tensor:
    """Mean over tokens of KL(softmax(t/tau) || softmax(s/tau))."""
    t = F.log_softmax(teacher_logits / tau, dim=-1)
    s = F.log_softmax(student_logits / tau, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


class _Clock:
    """Progress in [0, 1] by steps or by wall clock; drives LR and stopping."""

    def __init__(self, args: TrainArgs, already_elapsed: float = 0.0):
        assert (args.steps is None) != (args.minutes is None), "give steps or minutes"
        self.args = args
        self.t0 = time.time() - already_elapsed

    def elapsed(self) -> float:
        return time.time() - self.t0

    def progress(self, step: int) -> float:
        if self.args.steps is not None:
            return step / self.args.steps
        return self.elapsed() / (self.args.minutes * 60)

    def lr(self, step: int) -> float:
        a = self.args
        warm = min(1.0, (step + 1) / a.warmup_steps)
        p = min(1.0, self.progress(step))
        cos = a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
        return a.lr * warm * cos


def _optimizer(model, args: TrainArgs):
    # No weight decay on norms (1-D tensors); the tied embedding is decayed.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )


def run(model, train_tokens, heldout, args: TrainArgs, ckpt: Path, log, teacher=None) -> dict:
    """Train `model` in place. With `teacher`, distill from it (teacher frozen).

    Resumes from `ckpt` if present (model, optimizer, data RNG, step, elapsed).
    Returns a summary dict for the model card.
    """
    torch.manual_seed(args.seed)
    model.train()
    opt = _optimizer(model, args)
    data = Batches(train_tokens, args.seq_len, args.batch, args.seed)
    step, elapsed0, ema = 0, 0.0, None
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        data.rng.bit_generator.state = state["rng"]
        step, elapsed0, ema = state["step"], state["elapsed"], state["ema"]
        log(f"resumed from {ckpt} at step {step} ({elapsed0/60:.1f} min)")
    clock = _Clock(args, elapsed0)
    last_eval = last_ckpt = clock.elapsed()
    tokens_per_step = args.batch * args.seq_len
    history = []

    def do_eval():
        if teacher is None:
            r = {"heldout_ce": evaluate_ce(model, heldout)}
        else:
            r = {f"heldout_{k}": v for k, v in evaluate_kd(model, teacher, heldout).items()}
        r.update(step=step, minutes=clock.elapsed() / 60, train_loss_ema=ema)
        history.append(r)
        log("[eval] " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in r.items()))

    t_log = time.time()
    while clock.progress(step) < 1.0:
        lr = clock.lr(step)
        for g in opt.param_groups:
            g["lr"] = lr
        x = data.next()
        if teacher is None:
            loss = lm_loss(model, x)
        else:
            with torch.no_grad():
                t_logits = teacher(input_ids=x[:, :-1]).logits.float()
            s_logits = model(input_ids=x[:, :-1]).logits.float()
            tau = args.kd_temperature
            kd = _kl(t_logits, s_logits, tau) * tau * tau
            ce = F.cross_entropy(s_logits.reshape(-1, s_logits.size(-1)), x[:, 1:].reshape(-1))
            loss = args.kd_alpha * kd + (1 - args.kd_alpha) * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % args.log_every == 0:
            dt = time.time() - t_log
            t_log = time.time()
            log(f"step {step} loss {loss.item():.4f} ema {ema:.4f} lr {lr:.2e} "
                f"{args.log_every * tokens_per_step / dt:,.0f} tok/s "
                f"elapsed {clock.elapsed()/60:.1f} min progress {clock.progress(step):.3f}")
        now = clock.elapsed()
        if now - last_eval > args.eval_every_min * 60:
            do_eval()
            last_eval = now
        if now - last_ckpt > args.ckpt_every_min * 60:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "rng": data.rng.bit_generator.state, "step": step,
                        "elapsed": now, "ema": ema}, ckpt)
            last_ckpt = now
    do_eval()
    model.eval()
    return {"steps": step, "tokens_seen": step * tokens_per_step,
            "minutes": clock.elapsed() / 60, "train_loss_ema": ema,
            "final": history[-1], "history": history,
            "args": {k: v for k, v in vars(args).items()}}

"""Which of torch's attention implementations the lean engine's SDPA calls
may use: `SPECD_ATTENTION_BACKENDS`, a comma list of flash, efficient,
cudnn, math (e.g. "flash,efficient,math"); unset, "" or "auto": torch's own
choice for each call.

Why a setting: on CUDA torch picks among several implementations per call,
and on a Hopper GPU it picked cuDNN's for the engine's masked, grouped-query
calls (benchmarks/gpu.py's profile). cuDNN builds an execution plan for each
new shape, and a served step's shapes change every step (the keys grow by the
accepted tokens, the batch by the sessions in it), so the plan cost can
recur where a fixed-shape timing never shows it. Which implementation wins
is a measurement per device (benchmarks/README.md, "Verify, draft and cycle
costs on a GPU"); this setting is what that measurement toggles, and what an
operator sets once it has spoken. A name torch does not have fails at start,
naming the value.

`SPECD_KEY_BUCKET` (rows; 0, the default: off) serves the same question from
the other side: it keeps the shapes fewer instead of the implementation
different (specd_core/runtime/lean_step.py rounds each step's key columns up
to a multiple of it).

`SPECD_FOLD_HEADS` (auto, the default | on | off): whether a grouped-query
model's query heads ride as query rows, one block per KV head
(lean_step.fold_heads). auto: on a CPU, where it was measured to pay; on
lets a GPU run measure it (`python -m benchmarks.attention --device cuda`
then times it as `gather` against `grouped`); CUDA graphs capture the
unfolded call either way."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ENV = "SPECD_ATTENTION_BACKENDS"
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def parse_backends(text: str | None) -> list[SDPBackend] | None:
    """The backends a setting names, in its order; None: torch's choice.
    Raises ValueError naming an unknown name and the known ones."""
    t = (text or "").strip().lower()
    if t in ("", "auto"):
        return None
    names = [n.strip() for n in t.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(
            f"{ENV}={text!r}: unknown attention backend(s) {unknown or [text]}; "
            f"want a comma list of {', '.join(BACKENDS)}, or auto"
        )
    return [BACKENDS[n] for n in names]


KEY_BUCKET_ENV = "SPECD_KEY_BUCKET"


def key_bucket_from_env() -> int:
    """`SPECD_KEY_BUCKET`: key columns per step rounded up to a multiple of
    this many (specd_core/runtime/lean_step.py); unset, 0 or 1: exact."""
    text = os.environ.get(KEY_BUCKET_ENV, "").strip()
    try:
        value = int(text or 0)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{KEY_BUCKET_ENV}={text!r}: want a whole number of key rows (0: off)")
    return value


FOLD_ENV = "SPECD_FOLD_HEADS"
FOLD_MODES = ("auto", "on", "off")


def fold_from_env() -> str:
    """`SPECD_FOLD_HEADS`: auto | on | off (unset: auto); another value fails at start, named."""
    value = os.environ.get(FOLD_ENV, "").strip().lower() or "auto"
    if value not in FOLD_MODES:
        raise ValueError(f"{FOLD_ENV}={os.environ.get(FOLD_ENV)!r}: want one of {', '.join(FOLD_MODES)}")
    return value


def from_env() -> list[SDPBackend] | None:
    return parse_backends(os.environ.get(ENV))


def check_runs(
    backends: list[SDPBackend] | None,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    """Raise ValueError, naming the setting and the device, when none of
    `backends` can run the engine's kind of call there (a masked call with
    this many query and KV heads): e.g. cuDNN's alone on a CPU. Checked when
    a model loads, so that a replica stops at start instead of failing every
    forward."""
    if backends is None:
        return
    q = torch.zeros(2, heads, 3, head_dim, device=device, dtype=dtype)
    kv = torch.zeros(2, kv_heads, 5, head_dim, device=device, dtype=dtype)
    mask = torch.zeros(2, 1, 3, 5, device=device, dtype=dtype)
    try:
        with sdpa_kernel(backends):
            F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=heads != kv_heads)
    except RuntimeError as exc:
        names = ", ".join(n for n, b in BACKENDS.items() if b in backends)
        raise ValueError(
            f"{ENV}={os.environ.get(ENV)!r}: none of {names} runs this model's attention on {device} ({exc})"
        ) from exc


def restricted(backends: list[SDPBackend] | None) -> contextlib.AbstractContextManager:
    """A context in which SDPA calls use only `backends` (None: any)."""
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)

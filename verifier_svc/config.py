from __future__ import annotations

from dataclasses import dataclass

from specd_core.net.grpc_util import MAX_MESSAGE_BYTES
from specd_core.net.security import TlsConfig


@dataclass(frozen=True)
class VerifierConfig:
    model_dir: str  # HF causal LM directory (the target)
    # Loopback by default: only the orchestrator talks to a replica, and on one
    # machine it is local. On Ray, deploy binds the node's own IP (what the
    # orchestrator on another node dials); see specd/ray_deploy.py.
    host: str = "127.0.0.1"
    port: int = 50061  # 0 = pick a free port
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # float32 | float16 | bfloat16 | auto (the checkpoint's own). float32 by
    # default: a CPU has no fast half-precision path (docs/configuration.md).
    dtype: str = "float32"
    max_draft_tokens: int = 16  # draft depth limit per verify call (K for a chain)
    max_tree_nodes: int = 64  # draft tree size limit per verify call
    max_sessions: int = 256  # open sessions at once; past it: RESOURCE_EXHAUSTED
    # The KV cache budget, a pool of blocks (specd_core/runtime/kv_budget.py): bytes
    # ("512MiB", "4GiB") or a fraction in (0, 1] of the memory free once the
    # weights are loaded; "auto" = 0.85 on CUDA, 0.5 on a CPU (why: kv_budget's
    # DEFAULT_FRACTION). Past it OpenSession, and a call that would grow a
    # session's cache, are RESOURCE_EXHAUSTED.
    kv_cache_memory: str = "auto"
    kv_block_size: int = 64  # tokens (cache rows) per block of that budget
    # A session without a call for this long is closed and its KV cache freed
    # (its client is gone without closing it); later calls get NOT_FOUND saying
    # it expired. 0 = never.
    session_idle_timeout_s: float = 600.0
    # Calls waiting for a batch past this many: RESOURCE_EXHAUSTED (a bounded
    # queue; the orchestrator sends one call per session at a time, so only a
    # misbehaving client gets here).
    max_queued_calls: int = 1024
    engine: str = "auto"  # auto (lean forward where supported) | lean | hf
    torch_threads: int = 0  # 0 = torch default
    # Before serving, run a forward of each shape the batcher runs
    # (specd_core/runtime/warmup.py), so that no request pays the first calls'
    # one-off costs. Off: start faster (tests that start many replicas).
    warmup: bool = True
    grpc_workers: int = 8
    # Verify calls of concurrent sessions share one forward (lean engine; the HF
    # engine runs a batch's calls one after another), up to this many sessions.
    # 1 = one session per forward.
    max_batch_sessions: int = 32
    # Before a batch runs, wait for the verify calls of the other open sessions,
    # at most this fraction of the last batch's run time (specd_core/runtime/batcher.py: the
    # gather window; without it sessions split into groups that take turns).
    # 0 = run at once with what is queued.
    batch_wait_fraction: float = 0.5
    tls: TlsConfig | None = None  # TLS / mTLS on this server (specd_core.net.security); None = plaintext
    max_message_bytes: int = MAX_MESSAGE_BYTES  # per message, both ways; over it: RESOURCE_EXHAUSTED
    # Dtype of the hidden states (EAGLE features) sent to sessions that ask:
    # float16 | bfloat16 (2 bytes per value either way).
    hidden_dtype: str = "float16"

"""What the two model services' configs share (drafter_svc/config.py,
verifier_svc/config.py), and so their common flags (`python -m drafter_svc`,
`python -m verifier_svc`; specd_core/net/flags.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from specd_core.net.flags import flag, flag_group, not_flag
from specd_core.net.grpc_util import MAX_MESSAGE_BYTES
from specd_core.net.security import TlsConfig, add_tls_flags, tls_from_args
from specd_core.runtime.hub import PICKLE_HINT

# Weights dtypes a replica loads (specd_core/runtime/models.py loads them; the
# same list as its DTYPE_CHOICES, kept here so that no config imports torch).
DTYPES = ("float32", "float16", "bfloat16", "auto", "default")
ENGINES = ("auto", "lean", "hf")
PORT_HELP = "0 = any free port"
MAX_SESSIONS_HELP = "open sessions at once; past it OpenSession is RESOURCE_EXHAUSTED"
BATCH_WAIT_HELP = (
    "wait for other open sessions' calls before a batch, at most this fraction "
    "of the last batch's run time (0 = no waiting)"
)


def kv_memory_arg(text: str) -> str:
    """--kv-cache-memory, checked at parse time (the error names the value)."""
    from specd_core.runtime.kv_budget import parse_memory

    try:
        parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_server_tls_flags(parser) -> None:
    add_tls_flags(parser, server=True)


@dataclass(frozen=True)
class ModelServiceConfig:
    # A directory, or a Hugging Face repo id (`org/name[@rev]`) that the service
    # resolves to its directory in the Hugging Face cache before loading
    # (specd_core/runtime/hub.py).
    model_dir: str = field(
        metadata=flag("Hugging Face causal LM: a directory or a repo id (org/name)", name="--model", required=True)
    )
    revision: str | None = field(
        default=None, metadata=flag("with a repo id: a branch, tag or commit (or --model org/name@rev)")
    )
    # Pickle weights (.bin/.pt) can run code when loaded: a model without
    # safetensors is refused unless this is set.
    allow_pickle_weights: bool = field(
        default=False, metadata=flag(f"no safetensors weights: {PICKLE_HINT}", action="store_true")
    )
    port: int = field(default=0, metadata=flag(PORT_HELP))  # each service its own default
    # Loopback by default: only the orchestrator talks to a replica, and on one
    # machine it is local. On Ray, deploy binds the node's own IP (what the
    # orchestrator on another node dials); see specd/ray_deploy.py.
    host: str = field(
        default="127.0.0.1",
        metadata=flag("interface to listen on (default loopback: only a local orchestrator can reach it)"),
    )
    device: str = field(default="auto", metadata=flag("auto | cpu | cuda | cuda:N"))
    # float32 on a CPU (no fast half-precision path), the checkpoint's own on a
    # GPU (docs/configuration.md).
    dtype: str = field(
        default="default",
        metadata=flag(
            "weights dtype; auto = the checkpoint's own (float32 when its config names none); "
            "default = float32 on a CPU, auto on a GPU",
            choices=DTYPES,
        ),
    )
    engine: str = field(
        default="auto",
        metadata=flag("auto: the lean forward where the model is supported, else Hugging Face's (hf)", choices=ENGINES),
    )
    max_draft_tokens: int = field(default=16, metadata=flag())  # K (chain length / tree depth) limit per call
    torch_threads: int = field(default=0, metadata=flag())  # 0 = torch default
    # Calls of concurrent sessions share forwards (lean engine; the verifier's
    # HF engine runs a batch's calls one after another), up to this many sessions.
    # A lean step of n sessions costs less than two of n / 2 (python -m
    # benchmarks.engine, a verify of 5 rows each: 8 / 32 / 64 sessions 31 / 79
    # / 128 ms), so a cap only splits the open sessions into groups that take
    # turns, each waiting through the others' steps: the default lets every
    # session a verifier admits by default share one.
    max_batch_sessions: int = field(
        default=256, metadata=flag("sessions whose calls may share one forward (1 = no batching)")
    )
    # Before a batch runs, wait for the calls of the other open sessions that
    # are expected straight back, at most this fraction of the last batch's run
    # time (specd_core/runtime/batcher.py: the gather window; without it plain
    # decoding sessions split into groups that take turns). 0 = run at once
    # with what is queued. The drafter's default is 0 (drafter_svc/config.py).
    batch_wait_fraction: float = field(default=0.5, metadata=flag(BATCH_WAIT_HELP))
    max_sessions: int = field(default=1024, metadata=flag(MAX_SESSIONS_HELP))  # each service its own default
    # The KV cache budget, a pool of blocks (specd_core/runtime/kv_budget.py): bytes
    # ("512MiB", "4GiB") or a fraction in (0, 1] of the memory free once the
    # weights are loaded; "auto" = 0.85 on CUDA, 0.5 on a CPU (why: kv_budget's
    # DEFAULT_FRACTION). Past it OpenSession, and a call that would grow a
    # session's cache, are RESOURCE_EXHAUSTED.
    kv_cache_memory: str = field(
        default="auto",
        metadata=flag(
            "KV cache budget: bytes (512MiB, 4GiB) or a fraction in (0, 1] of the memory free "
            "after loading the weights (default auto: 0.85 on CUDA, 0.5 on a CPU); past it "
            "RESOURCE_EXHAUSTED",
            type=kv_memory_arg,
        ),
    )
    kv_block_size: int = field(  # tokens (cache rows) per block of that budget
        default=64, metadata=flag("tokens per block of the KV budget (sessions take and give back whole blocks)")
    )
    # A session without a call for this long is closed and its KV cache freed
    # (its client is gone without closing it); later calls get NOT_FOUND saying
    # it expired. 0 = never.
    session_idle_timeout_s: float = field(
        default=600.0, metadata=flag("close a session without a call for this long (0 = never)")
    )
    # The sessions of an orchestrator not heard from (no call of it, no
    # keep-alive) for this long are closed: it died, and its sessions would
    # otherwise hold KV until the idle timeout, which must stay long for slow
    # clients. A live orchestrator sends a keep-alive every quarter of it
    # (orchestrator/fleet/keepalive.py). Sessions opened without an owner keep
    # only the idle rule. 0 = never.
    owner_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "close the sessions of an orchestrator not heard from (calls, keep-alives) for this long (0 = never)"
        ),
    )
    # Calls waiting for a batch past this many: RESOURCE_EXHAUSTED (a bounded
    # queue; the orchestrator sends one call per session at a time, so only a
    # misbehaving client gets here).
    max_queued_calls: int = field(default=1024, metadata=flag("calls waiting for a batch; past it RESOURCE_EXHAUSTED"))
    # per message, both ways; over it: RESOURCE_EXHAUSTED
    max_message_bytes: int = field(
        default=MAX_MESSAGE_BYTES, metadata=flag("largest gRPC message either way (over it: RESOURCE_EXHAUSTED)")
    )
    # Before serving, run a forward of each shape the batcher runs
    # (specd_core/runtime/warmup.py), so that no request pays the first calls'
    # one-off costs. Off: start faster (tests that start many replicas).
    warmup: bool = field(
        default=True,
        metadata=flag(
            "serve at once, without first running a forward of each shape (the first calls pay their one-off costs)",
            name="--no-warmup",
            action="store_false",
            dest="warmup",
        ),
    )
    # Automatic prefix caching (lean engine; specd_core/runtime/prefix_cache.py):
    # full KV blocks of prompts stay cached, shared by later sessions whose
    # prompts start alike, and are evicted least recently used when the budget
    # needs room. Off: every prompt is prefilled whole.
    prefix_caching: bool = field(
        default=True,
        metadata=flag(
            "prefill every prompt whole: no reuse of cached KV blocks of earlier prompts' identical prefixes",
            name="--no-prefix-caching",
            action="store_false",
            dest="prefix_caching",
        ),
    )
    # TLS / mTLS on this server (specd_core.net.security); None = plaintext
    tls: TlsConfig | None = field(default=None, metadata=flag_group(add_server_tls_flags, tls_from_args))
    max_tree_nodes: int = field(default=64, metadata=not_flag("fixed: the protocol's tree size limit per call"))
    grpc_workers: int = field(default=8, metadata=not_flag("fixed: the gRPC server's threads"))

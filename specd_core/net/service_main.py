"""Shared `python -m drafter_svc|verifier_svc` entry: flags -> config -> serve.

Both model services take the same flags; each passes its config class and a
`start(config) -> (server, port)` function.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from specd_core.net.grpc_util import prefer_latency
from specd_core.net.security import SecurityConfigError, TlsConfig, add_tls_flags, tls_from_args
from specd_core.runtime.hub import PICKLE_HINT, ModelSpecError, resolve_model
from specd_core.runtime.kv_budget import parse_memory
from specd_core.runtime.models import DTYPE_CHOICES
from specd_core.telemetry import metrics, tracing


def model_service_main(name: str, config_cls, start, argv=None) -> None:
    parser = _build_parser(name, config_cls)
    args = parser.parse_args(argv)
    tls = _checked_tls(parser, name, args)
    try:  # a repo id: its directory in the Hugging Face cache, fetched now if missing
        args.model = resolve_model(args.model, args.revision, args.allow_pickle_weights, "--model").path
    except ModelSpecError as exc:
        parser.exit(2, f"{name}: {exc}\n")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    # service.name "verifier" / "drafter" unless OTEL_SERVICE_NAME says otherwise.
    tracing.setup(name.rsplit(".", 1)[-1])
    prefer_latency()
    _serve(name, _config_from_args(config_cls, args, tls), start, args)


def _build_parser(name: str, config_cls) -> argparse.ArgumentParser:
    """The flags of a model service; the optional groups only where config_cls
    has the field (batching: verifier; --target-dir: drafter)."""
    parser = argparse.ArgumentParser(prog=f"python -m {name}")
    _add_model_flags(parser, config_cls)
    _add_capacity_flags(parser, config_cls)
    if hasattr(config_cls, "target_dir"):
        parser.add_argument(
            "--target-dir",
            default="",
            help="method eagle (--model is an EAGLE head): the "
            "target directory it shares embedding and LM head with (default: the head's config)",
        )
    _add_serving_flags(parser, config_cls)
    add_tls_flags(parser, server=True)
    return parser


def _add_model_flags(parser: argparse.ArgumentParser, config_cls) -> None:
    """Which model, where it listens, how it runs."""
    parser.add_argument("--model", required=True, help="Hugging Face causal LM: a directory or a repo id (org/name)")
    parser.add_argument("--revision", help="with a repo id: a branch, tag or commit (or --model org/name@rev)")
    parser.add_argument("--allow-pickle-weights", action="store_true", help=f"no safetensors weights: {PICKLE_HINT}")
    parser.add_argument("--port", type=int, default=config_cls.port, help="0 = any free port")
    parser.add_argument(
        "--host",
        default=config_cls.host,
        help="interface to listen on (default loopback: only a local orchestrator can reach it)",
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="weights dtype; auto = the checkpoint's own (float32 when its config names none)",
    )
    parser.add_argument(
        "--engine",
        default=config_cls.engine,
        choices=["auto", "lean", "hf"],
        help="auto: the lean forward where the model is supported, else Hugging Face's (hf)",
    )
    parser.add_argument("--max-draft-tokens", type=int, default=config_cls.max_draft_tokens)
    parser.add_argument("--torch-threads", type=int, default=0)


def _add_capacity_flags(parser: argparse.ArgumentParser, config_cls) -> None:
    """Batching, and the limits past which calls are RESOURCE_EXHAUSTED."""
    if hasattr(config_cls, "max_batch_sessions"):
        parser.add_argument(
            "--max-batch-sessions",
            type=int,
            default=config_cls.max_batch_sessions,
            help="sessions whose verify calls may share one forward (1 = no batching)",
        )
        parser.add_argument(
            "--batch-wait-fraction",
            type=float,
            default=config_cls.batch_wait_fraction,
            help="wait for other open sessions' calls before a batch, at most this fraction "
            "of the last batch's run time (0 = no waiting)",
        )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=config_cls.max_sessions,
        help="open sessions at once; past it OpenSession is RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=_kv_memory,
        default=config_cls.kv_cache_memory,
        help="KV cache budget: bytes (512MiB, 4GiB) or a fraction in (0, 1] of the memory free "
        "after loading the weights (default auto: 0.85 on CUDA, 0.5 on a CPU); past it "
        "RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--kv-block-size",
        type=int,
        default=config_cls.kv_block_size,
        help="tokens per block of the KV budget (sessions take and give back whole blocks)",
    )
    parser.add_argument(
        "--session-idle-timeout-s",
        type=float,
        default=config_cls.session_idle_timeout_s,
        help="close a session without a call for this long (0 = never)",
    )
    parser.add_argument(
        "--max-queued-calls",
        type=int,
        default=config_cls.max_queued_calls,
        help="calls waiting for a batch; past it RESOURCE_EXHAUSTED",
    )


def _add_serving_flags(parser: argparse.ArgumentParser, config_cls) -> None:
    """Metrics, message size, shutdown."""
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 = any free port; default: off)"
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=config_cls.max_message_bytes,
        help="largest gRPC message either way (over it: RESOURCE_EXHAUSTED)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="serve at once, without first running a forward of each shape (the first calls pay their one-off costs)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds running calls get after SIGTERM (health turns NOT_SERVING at once)",
    )


def _kv_memory(text: str) -> str:
    """--kv-cache-memory, checked at parse time (the error names the value)."""
    try:
        parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _checked_tls(parser: argparse.ArgumentParser, name: str, args: argparse.Namespace) -> TlsConfig | None:
    """The TLS flags as a config, its files checked; a bad one exits (status 2)."""
    try:
        tls = tls_from_args(args)
        if tls:
            tls.check(server=True)  # before the (slow) model load, naming the bad file
    except SecurityConfigError as exc:
        parser.exit(2, f"{name}: {exc}\n")
    return tls


def _config_from_args(config_cls, args: argparse.Namespace, tls: TlsConfig | None):
    """The service's config from its parsed flags."""
    extra = {k: getattr(args, k) for k in ("max_batch_sessions", "batch_wait_fraction") if hasattr(args, k)}
    if hasattr(args, "target_dir"):
        extra["target_dir"] = args.target_dir
    return config_cls(
        model_dir=args.model,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        engine=args.engine,
        max_draft_tokens=args.max_draft_tokens,
        torch_threads=args.torch_threads,
        tls=tls,
        max_message_bytes=args.max_message_bytes,
        max_sessions=args.max_sessions,
        session_idle_timeout_s=args.session_idle_timeout_s,
        max_queued_calls=args.max_queued_calls,
        kv_cache_memory=args.kv_cache_memory,
        kv_block_size=args.kv_block_size,
        warmup=args.warmup,
        **extra,
    )


def _serve(name: str, config, start, args: argparse.Namespace) -> None:
    """Start the service, announce its ports, serve until SIGTERM / SIGINT, stop gracefully."""
    server, port = start(config)
    if args.metrics_port is not None:
        # Printed before the "listening on" line, which tests and scripts wait for.
        print(f"{name} metrics on {config.host}:{metrics.serve(args.metrics_port, config.host)}", flush=True)
    # Tests and scripts wait for this exact line to learn the bound port.
    print(f"{name} listening on {config.host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    # Graceful: health NOT_SERVING, refuse new calls, give running ones the grace period.
    server.stop(grace=args.shutdown_grace).wait()
    tracing.shutdown()  # export the spans still queued

"""Shared `python -m drafter_svc|verifier_svc` entry: flags -> config -> serve.

Both model services take the same flags; each passes its config class and a
`start(config) -> (server, port)` function.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading

from specd_core.net.flags import add_flags, config_from_args
from specd_core.net.grpc_util import prefer_latency, start_sync_server
from specd_core.net.security import SecurityConfigError, TlsConfig, tls_from_args
from specd_core.runtime import attention_backends, step_graphs
from specd_core.runtime.hub import ModelSpecError, resolve_model
from specd_core.runtime.reaper import start_reaper
from specd_core.telemetry import metrics, tracing


def serve_model_core(core, config, add_servicer, servicer, service_name: str):
    """Start a model service (drafter or verifier) on its core: warm it up,
    expire idle sessions, serve; return (server, port)."""
    if config.warmup:  # before the server exists: health says SERVING only once warm
        core.warm_up()
    start_reaper(core)  # idle and orphaned sessions expire (session_idle_timeout_s, owner_timeout_s)
    return start_sync_server(
        add_servicer,
        servicer,
        service_name,
        config.host,
        config.port,
        config.grpc_workers,
        config.tls,
        config.max_message_bytes,
    )


def model_service_main(name: str, config_cls, start, argv=None) -> None:
    parser = _build_parser(name, config_cls)
    args = parser.parse_args(argv)
    tls = _checked_tls(parser, name, args)
    config = _config_from_args(config_cls, args, tls)
    try:  # read by the engine at load: checked before the (slow) model load
        attention_backends.from_env()
        attention_backends.key_bucket_from_env()
        attention_backends.fold_from_env()
        step_graphs.mode_from_env()
    except ValueError as exc:
        parser.exit(2, f"{name}: {exc}\n")
    try:  # a repo id: its directory in the Hugging Face cache, fetched now if missing
        resolved = resolve_model(config.model_dir, config.revision, config.allow_pickle_weights, "--model")
    except ModelSpecError as exc:
        parser.exit(2, f"{name}: {exc}\n")
    config = dataclasses.replace(config, model_dir=resolved.path)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    # service.name "verifier" / "drafter" unless OTEL_SERVICE_NAME says otherwise.
    tracing.setup(name.rsplit(".", 1)[-1].removesuffix("_svc"))
    prefer_latency()
    _serve(name, config, start, args)


def _build_parser(name: str, config_cls) -> argparse.ArgumentParser:
    """The flags of a model service: one per field of config_cls that has one
    (specd_core/net/service_config.py), and the process's own."""
    parser = argparse.ArgumentParser(prog=f"python -m {name}")
    add_flags(parser, config_cls)
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 = any free port; default: off)"
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds running calls get after SIGTERM (health turns NOT_SERVING at once)",
    )
    return parser


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
    """The service's config from its parsed flags (TLS as already checked)."""
    return config_from_args(config_cls, args, tls=tls)


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

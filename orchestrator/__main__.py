"""`python -m orchestrator --target DIR [--drafter DIR] --verifier-address ADDR [--drafter-address ADDR] --port N
[--metrics-port M] [--http-port H] [--share-ports first|join]`

Runs the orchestrator against already running services, without Ray (useful for
debugging one machine); `specd up` is the normal way, with replicas on Ray.
Several can serve one port (--share-ports; specd.local_stack.Stack starts
them so); off Ray each reports and admits on its own.
"""

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from orchestrator.config import OrchestratorConfig
from orchestrator.edge.server import start_async
from specd_core.net import flags
from specd_core.net.auth import tokens_from_env_and_file
from specd_core.net.exposure import check_exposure
from specd_core.net.flags import add_flags
from specd_core.net.grpc_util import prefer_latency
from specd_core.net.security import SecurityConfigError, TlsConfig, tls_from_args
from specd_core.runtime.hub import ModelSpecError, resolve_model
from specd_core.telemetry import metrics, tracing


def parser() -> argparse.ArgumentParser:
    """A flag per OrchestratorConfig field that has one, and --metrics-port."""
    p = argparse.ArgumentParser(prog="python -m orchestrator")
    add_flags(p, OrchestratorConfig)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here (0 = any free port; default: off)")
    return p


def config_from_args(args: argparse.Namespace, tls: TlsConfig | None) -> OrchestratorConfig:
    """The config from the parsed flags (TLS as already checked)."""
    return flags.config_from_args(OrchestratorConfig, args, tls=tls)


async def serve(config: OrchestratorConfig, metrics_port: int | None) -> None:
    """Serve until SIGTERM / SIGINT, then drain."""
    if metrics_port is not None:
        # Before the "listening on" line, which tests and scripts wait for.
        print(f"orchestrator metrics on {config.host}:{metrics.serve(metrics_port, config.host)}", flush=True)
    serving = await start_async(config)
    if serving.http:  # before the "listening on" line, which tests and scripts wait for
        print(f"orchestrator http on {serving.http_url}", flush=True)
    print(f"orchestrator listening on {config.host}:{serving.port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    print("orchestrator draining", flush=True)
    await serving.drain_and_stop(config.shutdown_grace_s)


def checked_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> OrchestratorConfig:
    """The config from the flags, checked before anything starts (exit 2 with
    the reason): TLS files, tokens, who can reach the API, the models (a repo
    id becomes its directory in the Hugging Face cache)."""
    try:
        tls = tls_from_args(args)
        if tls:
            tls.check(server=True)
        tokens = tokens_from_env_and_file(args.auth_tokens_file)  # fail now, naming the file
        warning = check_exposure(args.host, tls, bool(tokens), args.insecure)
    except SecurityConfigError as exc:
        p.exit(2, f"orchestrator: {exc}\n")
    if warning:
        print(f"orchestrator: {warning}", file=sys.stderr, flush=True)
    try:
        config = config_from_args(args, tls)
    except ValueError as exc:  # a setting out of its range (e.g. the hang detection's)
        p.exit(2, f"orchestrator: {exc}\n")
    try:
        return dataclasses.replace(
            config,
            target_dir=resolve_model(config.target_dir, what="--target", weights=False).path,
            drafter_dir=config.drafter_dir and resolve_model(config.drafter_dir, what="--drafter", weights=False).path,
        )
    except ModelSpecError as exc:
        p.exit(2, f"orchestrator: {exc}\n")


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    config = checked_config(p, args)
    logging.basicConfig(level=logging.INFO)
    tracing.setup("orchestrator")  # only if OTEL_EXPORTER_OTLP_*ENDPOINT is set
    prefer_latency()
    asyncio.run(serve(config, args.metrics_port))
    tracing.shutdown()  # export the spans still queued


if __name__ == "__main__":
    main()

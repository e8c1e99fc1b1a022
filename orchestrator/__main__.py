"""`python -m orchestrator --target DIR [--drafter DIR] --verifier-address ADDR [--drafter-address ADDR] --port N
[--metrics-port M] [--http-port H] [--share-ports first|join]`

Runs the orchestrator against already running services, without Ray (useful for
debugging one machine); `specd up` is the normal way, with replicas on Ray.
Several can serve one port (--share-ports; specd.local_stack.Stack starts
them so); off Ray each reports and admits on its own.
"""

import argparse
import asyncio
import logging
import signal
import sys

from orchestrator.config import OrchestratorConfig, add_http_flags
from orchestrator.edge.server import start_async
from orchestrator.spec_config import add_speculative_flags, speculative_config_from_args
from specd_core.net.auth import tokens_from_env_and_file
from specd_core.net.exposure import add_exposure_flags, check_exposure
from specd_core.net.grpc_util import MAX_MESSAGE_BYTES, prefer_latency
from specd_core.net.security import SecurityConfigError, TlsConfig, add_tls_flags, tls_from_args
from specd_core.runtime.hub import ModelSpecError, resolve_model
from specd_core.telemetry import metrics, tracing


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m orchestrator")
    p.add_argument("--target", required=True, help="target model dir or repo id (tokenizer, context length)")
    p.add_argument("--drafter", help="drafter model dir or repo id")
    p.add_argument("--verifier-address", action="append", required=True)
    p.add_argument("--drafter-address", action="append", default=[])
    add_exposure_flags(p)
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--share-ports",
        choices=["first", "join"],
        default="",
        help="serve --port and --http-port together with other orchestrators of this deployment "
        "(SO_REUSEPORT: the kernel spreads connections over them): first = the group's first, "
        "which checks the ports are free; join = one more on the ports the first holds",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here (0 = any free port; default: off)")
    add_http_flags(p)
    p.add_argument(
        "--auth-tokens-file",
        help="bearer tokens the public API accepts, one per line "
        "($SPECD_AUTH_TOKENS adds comma-separated ones); default: no authentication",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=MAX_MESSAGE_BYTES,
        help="largest gRPC message on every link (over it: RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--shutdown-grace", type=float, default=30.0, help="seconds running streams get to finish after SIGTERM"
    )
    add_tls_flags(p, server=True)
    p.add_argument(
        "--max-active-requests",
        type=int,
        default=OrchestratorConfig.max_active_requests,
        help="concurrent Generate streams; past it RESOURCE_EXHAUSTED",
    )
    add_speculative_flags(p)
    return p


def config_from_args(args: argparse.Namespace, tls: TlsConfig | None) -> OrchestratorConfig:
    return OrchestratorConfig(
        target_dir=args.target,
        drafter_dir=args.drafter,
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        verifier_addresses=args.verifier_address,
        drafter_addresses=args.drafter_address,
        speculative=speculative_config_from_args(args),
        tls=tls,
        auth_tokens_file=args.auth_tokens_file,
        max_message_bytes=args.max_message_bytes,
        shutdown_grace_s=args.shutdown_grace,
        max_active_requests=args.max_active_requests,
        share_ports=args.share_ports,
    )


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


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
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
    try:  # repo ids (org/name@rev): their directories in the Hugging Face cache
        args.target = resolve_model(args.target, what="--target", weights=False).path
        args.drafter = args.drafter and resolve_model(args.drafter, what="--drafter", weights=False).path
    except ModelSpecError as exc:
        p.exit(2, f"orchestrator: {exc}\n")
    logging.basicConfig(level=logging.INFO)
    tracing.setup("orchestrator")  # only if OTEL_EXPORTER_OTLP_*ENDPOINT is set
    prefer_latency()
    asyncio.run(serve(config_from_args(args, tls), args.metrics_port))
    tracing.shutdown()  # export the spans still queued


if __name__ == "__main__":
    main()

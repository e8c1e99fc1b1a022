"""Shared `python -m drafter_svc|verifier_svc` entry: flags -> config -> serve.

Both model services take the same flags; each passes its config class and a
`start(config) -> (server, port)` function.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading

from . import metrics, telemetry


def model_service_main(name: str, config_cls, start, argv=None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {name}")
    parser.add_argument("--model", required=True, help="Hugging Face causal LM directory")
    parser.add_argument("--port", type=int, default=config_cls.port, help="0 = any free port")
    parser.add_argument("--host", default=config_cls.host)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--max-draft-tokens", type=int, default=config_cls.max_draft_tokens)
    parser.add_argument("--torch-threads", type=int, default=0)
    if hasattr(config_cls, "max_batch_sessions"):
        parser.add_argument("--max-batch-sessions", type=int, default=config_cls.max_batch_sessions,
                            help="sessions whose verify calls may share one forward (1 = no batching)")
    if hasattr(config_cls, "target_dir"):
        parser.add_argument("--target-dir", default="", help="method eagle (--model is an EAGLE head): the "
                            "target directory it shares embedding and LM head with (default: the head's config)")
    parser.add_argument("--metrics-port", type=int,
                        help="serve Prometheus /metrics on this port (0 = any free port; default: off)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    # service.name "verifier" / "drafter" unless OTEL_SERVICE_NAME says otherwise.
    telemetry.setup(name.removesuffix("_svc"))
    extra = {"max_batch_sessions": args.max_batch_sessions} if hasattr(args, "max_batch_sessions") else {}
    if hasattr(args, "target_dir"):
        extra["target_dir"] = args.target_dir
    config = config_cls(model_dir=args.model, host=args.host, port=args.port, device=args.device,
                        dtype=args.dtype, max_draft_tokens=args.max_draft_tokens,
                        torch_threads=args.torch_threads, **extra)
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
    # Graceful: refuse new calls, give running ones a few seconds to finish.
    server.stop(grace=5).wait()
    telemetry.shutdown()      # export the spans still queued

"""`specd bench`: speculation off and on over the user's prompts (specd/bench.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specd.cli.client import auth_metadata, client_channel
from specd_core.net.security import SecurityConfigError
from specd_core.runtime.hub import ModelSpecError, resolve_pair


def cmd_bench(args) -> int:
    """Speculation off and on over the user's prompts at each concurrency level
    (specd/bench.py): against --address, else a local stack it starts."""
    import importlib.util

    from specd import bench

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(
            "specd bench: --plot needs matplotlib, which is not installed: pip install 'specd[bench]' "
            "(or give --plot '' for no plot)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.address is None:  # repo ids (org/name@rev): their directories in the Hugging Face cache
            pair = resolve_pair(args.target, args.drafter or None, None, None, args.allow_pickle_weights)
            args.target, args.drafter = pair.target.path, pair.drafter and pair.drafter.path
        cfg = _bench_config(args)
        channel_args = None if args.address is None else client_channel(args, args.address)
    except (bench.BenchError, SecurityConfigError, ModelSpecError) as exc:
        print(f"specd bench: {exc}", file=sys.stderr)
        return 2
    stack = None
    try:
        if channel_args is None:
            from specd.local_stack import Stack

            print(f"starting a local stack: target {args.target}, drafter {args.drafter}", file=sys.stderr)
            service_args: tuple[str, ...] = ("--dtype", args.dtype, "--device", args.device)
            service_args += ("--allow-pickle-weights",) if args.allow_pickle_weights else ()
            stack = Stack(args.target, args.drafter or None, service_args)
            channel = stack.channel
        else:
            channel = channel_args
        from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

        stub = pb_grpc.OrchestratorServiceStub(channel)
        metadata = auth_metadata(args)
        report = bench.run_bench(
            cfg,
            lambda req: stub.Generate(req, timeout=args.request_timeout, metadata=metadata),
            progress=sys.stderr.isatty(),
        )
    except (bench.BenchError, RuntimeError, TimeoutError) as exc:
        print(f"specd bench: {exc}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()
        elif channel_args is not None:
            channel_args.close()
    report["address"] = args.address or "local stack"
    report["target"], report["drafter"] = (None, None) if args.address else (args.target, args.drafter)
    Path(args.out).write_text(json.dumps(report, indent=2))
    if args.plot:
        bench.plot(report, Path(args.plot))
    print(bench.table(report))
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""), file=sys.stderr)
    return 0


def _bench_config(args):
    from specd import bench

    if args.settings:
        settings = bench.settings_from_file(Path(args.settings))
    else:
        settings = bench.settings_from_flags(args.methods, args.k, args.tree)
    if args.prompts:
        prompts = bench.load_prompts(Path(args.prompts))
    elif args.address:
        raise bench.BenchError("with --address, give --prompts FILE (the default prompts are the demo pair's)")
    else:
        prompts = bench.demo_prompts(args.target)
    if args.rounds < 1 or args.max_new_tokens < 1 or any(n < 1 for n in args.concurrency):
        raise bench.BenchError("--rounds, --max-new-tokens and --concurrency must be positive")
    return bench.BenchConfig(
        settings=settings,
        prompts=prompts,
        concurrency=list(args.concurrency),
        rounds=args.rounds,
        max_new_tokens=args.max_new_tokens,
        requests=args.requests,
    )

"""The client commands: `specd generate`, `status`, `scale` and
`metrics-targets`, over gRPC to the orchestrator (`specd up`'s address unless
--address)."""

from __future__ import annotations

import os
import sys

from specd import ray_cluster
from specd.cli.status import print_status
from specd_core.net.auth import CLIENT_TOKEN_ENV, bearer_metadata
from specd_core.net.grpc_util import open_channel
from specd_core.net.security import SecurityConfigError, tls_from_args

DEFAULT_ADDRESS = "127.0.0.1:50051"


def default_address(args) -> str:
    """--address, else the one `specd up` printed, else the default port here."""
    return args.address or (ray_cluster.read_state() or {}).get("address") or DEFAULT_ADDRESS


def cmd_generate(args) -> int:
    """Stream a completion; a stream that breaks (the orchestrator serving it
    died) is sent again and resumes after the tokens received (specd/client.py),
    unless --no-resume."""
    import grpc

    from specd.client import ResumePolicy, StreamBroken, stream_generate

    if not getattr(args, "chat", False) and getattr(args, "system", None) is not None:
        print("error: --system needs --chat", file=sys.stderr)
        return 2
    req = generate_request(args)
    try:
        channel = client_channel(args, default_address(args))
    except SecurityConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with channel:
        retries = ResumePolicy().retries if getattr(args, "resume", True) else 0
        stream = stream_generate(channel, req, metadata=auth_metadata(args), retries=retries)
        try:
            for r in stream:
                sys.stdout.write(r.text)
                sys.stdout.flush()
                if r.finish_reason:
                    print(_finish_line(r, stream.resumes), file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except StreamBroken as e:
            print(f"\nerror: {e}", file=sys.stderr)
            return 1
    return 0


def generate_request(args):
    """The GenerateRequest of `specd generate` (and `specd demo`): the prompt
    (or chat), sampling, and the per-request speculation flags given."""
    from specd_core.api.v1 import specdec_pb2 as pb

    req = pb.GenerateRequest(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop or [],
    )
    if getattr(args, "chat", False):
        req.messages.extend(chat_messages(args.prompt, args.system))
    else:
        req.prompt = args.prompt
    if args.seed is not None:
        req.seed = args.seed
    if args.num_speculative_tokens is not None:
        req.num_speculative_tokens = args.num_speculative_tokens
    if args.method:
        req.speculative_method = args.method
    for flag, name in (
        ("adaptive", "adaptive_speculation"),
        ("pipeline", "pipeline_drafting"),
        ("pipeline_alternatives", "pipeline_alternatives"),
    ):
        if getattr(args, flag, None) not in (None, "auto"):  # auto: the service's setting
            setattr(req, name, getattr(args, flag))
    if getattr(args, "confidence_threshold", None) not in (None, "auto"):  # auto: the service's setting
        req.confidence_threshold = args.confidence_threshold
    if args.tree or args.tree_budget or args.tree_paths:
        req.tree.CopyFrom(
            pb.DraftShape(
                branching=args.tree or [],
                node_budget=args.tree_budget or 0,
                max_depth=args.tree_depth or (6 if args.tree_budget else 0),
                paths=[pb.TreePath(ranks=p) for p in args.tree_paths or []],
            )
        )
    return req


def _finish_line(r, resumes: int = 0) -> str:
    """The last message's stats; resumes: the times the stream was sent again
    (the stats are then the last stream's, counting the tokens it resumed from)."""
    s = r.stats
    resumed = f" resumes={resumes} resumed_tokens={s.resumed_tokens}" if resumes else ""
    return (
        f"\n[finish={r.finish_reason} method={s.method} prompt_tokens={s.prompt_tokens} "
        f"completion_tokens={s.completion_tokens} K={s.num_speculative_tokens} "
        f"cycles={s.cycles} drafted={s.drafted_tokens} accepted={s.accepted_tokens} "
        f"mean_accepted_length={s.mean_accepted_length:.2f}{resumed}]"
    )


def chat_messages(prompt: str, system: str | None) -> list:
    """`--chat`: the prompt as the user's message, after --system's if given."""
    from specd_core.api.v1 import specdec_pb2 as pb

    turns = ([("system", system)] if system is not None else []) + [("user", prompt)]
    return [pb.ChatMessage(role=role, content=content) for role, content in turns]


def client_channel(args, address: str):
    """The channel the client commands use: TLS when a --tls-* flag is given."""
    tls = tls_from_args(args)
    if tls:
        tls.check(server=False)
    return open_channel(address, tls, retry_unavailable=True)


def auth_metadata(args):
    """--token, else $SPECD_TOKEN, as bearer metadata (nothing without one)."""
    return bearer_metadata(args.token or os.environ.get(CLIENT_TOKEN_ENV))


def _admin_call(args, method: str, request):
    from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

    address = default_address(args)
    with client_channel(args, address) as channel:
        return getattr(pb_grpc.AdminServiceStub(channel), method)(
            request, timeout=args.timeout, metadata=auth_metadata(args)
        )


def _admin(args, method: str, request, show) -> int:
    """One Admin call, its reply handed to `show`; exit 2 on bad TLS settings,
    1 on an RPC error (its code and details on stderr)."""
    import grpc

    try:
        reply = _admin_call(args, method, request)
    except SecurityConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    show(reply)
    return 0


def cmd_status(args) -> int:
    from specd_core.api.v1 import specdec_pb2 as pb

    return _admin(args, "Status", pb.StatusRequest(), print_status)


def cmd_scale(args) -> int:
    from specd_core.api.v1 import specdec_pb2 as pb

    if args.drafters is None and args.verifiers is None and args.orchestrators is None:
        print("specd scale: give --drafters N, --verifiers M and/or --orchestrators K", file=sys.stderr)
        return 2
    req = pb.ScaleRequest()
    if args.drafters is not None:
        req.drafters = args.drafters
    if args.verifiers is not None:
        req.verifiers = args.verifiers
    if args.orchestrators is not None:
        req.orchestrators = args.orchestrators
    return _admin(args, "Scale", req, print_status)


def cmd_metrics_targets(args) -> int:
    """Every /metrics endpoint as Prometheus file_sd JSON, from the
    orchestrator's Status: what it writes to its targets file."""
    from specd_core.api.v1 import specdec_pb2 as pb
    from specd_core.telemetry.discovery import dumps, file_sd_targets

    return _admin(
        args,
        "Status",
        pb.StatusRequest(),
        lambda status: sys.stdout.write(
            dumps(
                file_sd_targets(
                    status.replicas,
                    status.metrics_address,
                    [(o.name, o.metrics_address) for o in status.orchestrators if len(status.orchestrators) > 1],
                )
            )
        ),
    )

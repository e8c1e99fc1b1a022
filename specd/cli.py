"""`specd` command line: up, generate, status, scale, metrics-targets, down, demo, bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import add_http_flags
from orchestrator.spec_config import (
    DRAFTER_METHODS,
    METHODS,
    ConfigError,
    SpeculativeConfig,
    add_draft_shape_flags,
    add_speculative_flags,
    parse_branching,
    speculative_config_from_args,
)
from specd import ray_cluster
from specd_core.net.auth import CLIENT_TOKEN_ENV, bearer_metadata, tokens_from_env_and_file
from specd_core.net.exposure import add_exposure_flags, check_exposure
from specd_core.net.grpc_util import MAX_MESSAGE_BYTES, open_channel
from specd_core.net.security import SecurityConfigError, TlsConfig, add_tls_flags, tls_from_args
from specd_core.runtime.hub import ModelSpecError, add_model_flags, resolve_pair

TARGETS_FILE_NAME = "prometheus_targets.json"  # in $SPECD_HOME unless --metrics-targets-file

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO_ROOT / "models/demo/target"
DEMO_DRAFTER = REPO_ROOT / "models/demo/drafter"
DEMO_EAGLE = REPO_ROOT / "models/demo/eagle"
DEMO_PROMPT = "def read_config(path):\n    with open(path) as f:\n        return"


@dataclass
class _UpFlags:
    """What `specd up` read from its flags and checked before anything starts."""

    speculative: SpeculativeConfig
    autoscale: dict  # "verifier" | "drafter" -> AutoscalePolicy
    tls: TlsConfig | None
    tokens_file: str | None
    exposure_warning: str | None = None  # --insecure beyond loopback: what is exposed


def cmd_up(args, print_address: bool = True) -> int:
    if ray_cluster.read_state():
        print("specd is already up (run `specd down` first); state: " + str(ray_cluster.state_path()), file=sys.stderr)
        return 1
    try:
        flags = _check_up_flags(args)
    except (ConfigError, SecurityConfigError, OSError, ValueError) as exc:
        print(f"specd up: {exc}", file=sys.stderr)
        return 2
    problem = _choose_drafter(args, flags.speculative) or _pair_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if flags.exposure_warning:
        print(f"specd up: {flags.exposure_warning}", file=sys.stderr)
    try:
        ray_address, ray_pid = _ray_cluster(args)
        address = _deploy_on_ray(args, flags, ray_address, ray_pid).replace("0.0.0.0", "127.0.0.1")
        http = _http_address() if args.http_port else ""
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        # An actor that failed to start (DeployError: its own error, one line),
        # Ray not starting or not reachable. What was started is gone by now.
        print(f"specd up: {exc}", file=sys.stderr)
        return 1
    ray_cluster.write_state(
        {
            "address": address,
            "ray_address": ray_address,
            "ray_pid": ray_pid,
            "metrics_targets_file": _targets_file(args),
            "http": http,
        }
    )
    if print_address:  # stdout carries only the address, for scripts
        print(address)
    print(f"specd is up: Generate at {address} (ray {ray_address})", file=sys.stderr)
    if http:
        print(f"OpenAI-compatible HTTP API at {http}/v1", file=sys.stderr)
    return 0


def _check_up_flags(args) -> _UpFlags:
    """The speculative config, autoscaling policies, TLS and tokens from the
    flags. Certificates and tokens are checked here, before Ray starts, with
    the file named."""
    from orchestrator.fleet.scaling import AutoscalePolicy
    from specd_core.runtime.kv_budget import parse_memory

    parse_memory(args.kv_cache_memory)  # a ValueError naming the value, before Ray starts
    if not 1 <= args.orchestrators <= args.max_active_requests:
        raise ValueError(
            f"--orchestrators must be in [1, --max-active-requests ({args.max_active_requests})], "
            f"got {args.orchestrators}"
        )
    sc = speculative_config_from_args(args)
    autoscale = {
        kind: AutoscalePolicy.parse(text)
        for kind, text in (("verifier", args.autoscale_verifiers), ("drafter", args.autoscale_drafters))
        if text
    }
    tls = tls_from_args(args)
    if tls:
        tls.check(server=True)
    tokens_file = str(Path(args.auth_tokens_file).resolve()) if args.auth_tokens_file else None
    tokens = tokens_from_env_and_file(tokens_file)
    warning = check_exposure(args.host, tls, bool(tokens), args.insecure)
    _check_targets_file(_targets_file(args))
    return _UpFlags(sc, autoscale, tls, tokens_file, warning)


def _targets_file(args) -> str:
    """--metrics-targets-file, else $SPECD_HOME/prometheus_targets.json; absolute
    (the orchestrator actor runs in another directory, on this node)."""
    path = args.metrics_targets_file or ray_cluster.state_path().with_name(TARGETS_FILE_NAME)
    return str(Path(path).expanduser().resolve())


def _check_targets_file(path: str) -> None:
    """The targets file must be writable: checked before Ray starts, naming the
    path, rather than failing the orchestrator's start. Nothing is created here
    (a refused `specd up` leaves no trace); the orchestrator makes the missing
    directories when it writes the file, so the nearest existing one must be
    writable."""
    if Path(path).is_dir():
        raise OSError(f"--metrics-targets-file {path}: is a directory")
    existing = Path(path).parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise OSError(f"--metrics-targets-file {path}: {existing} is not a writable directory")


def _choose_drafter(args, sc: SpeculativeConfig) -> str | None:
    """Set args.drafter to the drafter to deploy: --drafter, else the config's
    `model`, else the demo drafter; '' deploys none (then only ngram and off
    can run). Returns what is wrong with the model directories, if anything."""
    drafter = (
        args.drafter
        if args.drafter is not None
        else (sc.model or str(DEMO_EAGLE if sc.method == "eagle" else DEMO_DRAFTER))
    )
    args.drafter = drafter or None
    try:  # a repo id becomes its directory in the Hugging Face cache; args.models keeps the ids
        args.models = resolve_pair(
            args.target, args.drafter, args.target_revision, args.drafter_revision, args.allow_pickle_weights
        )
    except ModelSpecError as exc:
        return f"specd up: {exc}"
    args.target, args.drafter = args.models.target.path, args.models.drafter and args.models.drafter.path
    if sc.method in DRAFTER_METHODS and not args.drafter:
        return f"specd up: speculative_config.method is {sc.method} but no drafter is given"
    return None


def _pair_problem(args) -> str | None:
    """Whether the drafter shares the target's tokenizer, checked here before
    Ray or any replica starts (the orchestrator checks again when it starts)."""
    from orchestrator.pair import IncompatiblePair, check_pair

    try:
        check_pair(args.target, args.drafter)
    except IncompatiblePair as exc:
        return f"specd up: {exc}"
    return None


def _ray_cluster(args) -> tuple[str, int | None]:
    """(Ray address, pid of the local Ray we started or None): --ray-address,
    else $RAY_ADDRESS, else a new local cluster."""
    ray_address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if ray_address:
        return ray_address, None
    ray_address, ray_pid = ray_cluster.start_private_ray()
    print(f"started a local Ray cluster at {ray_address} (loopback, token authentication)", file=sys.stderr)
    return ray_address, ray_pid


def _deploy_on_ray(args, flags: _UpFlags, ray_address: str, ray_pid: int | None) -> str:
    """Deploy the replicas and the orchestrator; the orchestrator's address.
    A failure leaves nothing running: deploy() kills the actors it started,
    this driver disconnects, and the local Ray cluster we started stops - in
    that order: a driver still connected when its cluster's head is stopped
    waits for the head at exit ("Failed to connect to GCS within 60 seconds")
    instead of exiting with the error."""
    import ray

    from specd.ray_deploy import DeploymentConfig, deploy

    try:
        ray.init(address=ray_address, namespace="specd", logging_level=logging.WARNING, log_to_driver=False)
        return deploy(
            DeploymentConfig(
                target_dir=str(Path(args.target).resolve()),
                drafter_dir=str(Path(args.drafter).resolve()) if args.drafter else None,
                target_model=args.models.target.spec,
                drafter_model=args.models.drafter.spec if args.models.drafter else "",
                allow_pickle_weights=args.allow_pickle_weights,
                host=args.host,
                port=args.port,
                http_port=args.http_port,
                served_model_name=getattr(args, "served_model_name", None),  # `specd demo` has no such flag
                num_verifiers=args.verifiers,
                num_drafters=args.drafters,
                num_orchestrators=args.orchestrators,
                max_active_requests=args.max_active_requests,
                device=args.device,
                dtype=args.dtype,
                replica_gpus=args.replica_gpus,
                speculative=flags.speculative,
                autoscale=flags.autoscale,
                ready_timeout_s=args.ready_timeout,
                tls=flags.tls,
                auth_tokens_file=flags.tokens_file,
                max_message_bytes=args.max_message_bytes,
                replica_host=args.replica_host,
                kv_cache_memory=args.kv_cache_memory,
                kv_block_size=args.kv_block_size,
                engine=args.engine,
                metrics_port=args.metrics_port,
                metrics_targets_file=_targets_file(args),
            ),
            warn=lambda line: print(line, file=sys.stderr),
        )
    except BaseException:
        with contextlib.suppress(Exception):
            ray.shutdown()
        if ray_pid:
            ray_cluster.stop_local_ray(ray_pid)
        raise


def _http_address() -> str:
    """The deployed orchestrator's HTTP API base URL (Ray still attached); a
    failure to ask is a warning: the deployment is up and serves gRPC."""
    from specd.ray_deploy import orchestrator_http_address

    try:
        return orchestrator_http_address()
    except Exception as exc:  # noqa: BLE001 - Ray's errors are not one class
        print(f"specd up: could not ask the orchestrator for its HTTP address: {exc}", file=sys.stderr)
        return ""


def cmd_down(args) -> int:
    state = ray_cluster.read_state()
    if not state:
        print("specd is not up (no state file)", file=sys.stderr)
        return 0
    if state.get("ray_pid"):
        # We own this cluster: stopping it takes every actor with it.
        ray_cluster.stop_local_ray(state["ray_pid"])
    else:
        import ray

        from specd.ray_deploy import teardown

        ray.init(address=state["ray_address"], namespace="specd", logging_level=logging.WARNING, log_to_driver=False)
        teardown()
    if state.get("metrics_targets_file"):
        # No targets left: Prometheus stops scraping what is gone (a missing
        # file would leave it logging errors instead).
        from specd_core.telemetry.discovery import dumps, write_atomic

        with contextlib.suppress(OSError):
            write_atomic(state["metrics_targets_file"], dumps([]))
    ray_cluster.clear_state()
    print("specd is down", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    import grpc

    from specd_core.api.v1 import specdec_pb2 as pb
    from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

    address = args.address or (ray_cluster.read_state() or {}).get("address") or "127.0.0.1:50051"
    req = pb.GenerateRequest(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop or [],
    )
    if getattr(args, "chat", False):
        req.messages.extend(chat_messages(args.prompt, args.system))
    elif getattr(args, "system", None) is not None:
        print("error: --system needs --chat", file=sys.stderr)
        return 2
    else:
        req.prompt = args.prompt
    if args.seed is not None:
        req.seed = args.seed
    if args.num_speculative_tokens is not None:
        req.num_speculative_tokens = args.num_speculative_tokens
    if args.method:
        req.speculative_method = args.method
    if getattr(args, "adaptive", None) is not None:
        req.adaptive_speculation = args.adaptive
    if getattr(args, "pipeline", None) is not None:
        req.pipeline_drafting = args.pipeline
    if getattr(args, "pipeline_alternatives", None) is not None:
        req.pipeline_alternatives = args.pipeline_alternatives
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
    try:
        channel = _client_channel(args, address)
    except SecurityConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with channel:
        try:
            for r in pb_grpc.OrchestratorServiceStub(channel).Generate(req, metadata=_auth(args)):
                sys.stdout.write(r.text)
                sys.stdout.flush()
                if r.finish_reason:
                    s = r.stats
                    print(
                        f"\n[finish={r.finish_reason} method={s.method} prompt_tokens={s.prompt_tokens} "
                        f"completion_tokens={s.completion_tokens} K={s.num_speculative_tokens} "
                        f"cycles={s.cycles} drafted={s.drafted_tokens} accepted={s.accepted_tokens} "
                        f"mean_accepted_length={s.mean_accepted_length:.2f}]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def chat_messages(prompt: str, system: str | None) -> list:
    """`--chat`: the prompt as the user's message, after --system's if given."""
    from specd_core.api.v1 import specdec_pb2 as pb

    turns = ([("system", system)] if system is not None else []) + [("user", prompt)]
    return [pb.ChatMessage(role=role, content=content) for role, content in turns]


def _client_channel(args, address: str):
    """The channel the client commands use: TLS when a --tls-* flag is given."""
    tls = tls_from_args(args)
    if tls:
        tls.check(server=False)
    return open_channel(address, tls, retry_unavailable=True)


def _auth(args):
    """--token, else $SPECD_TOKEN, as bearer metadata (nothing without one)."""
    return bearer_metadata(args.token or os.environ.get(CLIENT_TOKEN_ENV))


def _admin_call(args, method: str, request):
    from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

    address = args.address or (ray_cluster.read_state() or {}).get("address") or "127.0.0.1:50051"
    with _client_channel(args, address) as channel:
        return getattr(pb_grpc.AdminServiceStub(channel), method)(request, timeout=args.timeout, metadata=_auth(args))


def _kv_use(r) -> str:
    """A replica's KV budget use: used/capacity tokens (percent); '-' when unknown."""
    if not r.kv_capacity_tokens:
        return "-"
    return f"{r.kv_used_tokens}/{r.kv_capacity_tokens} ({100 * r.kv_used_tokens / r.kv_capacity_tokens:.0f}%)"


def print_status(status) -> None:
    rows = [
        ("POOL", "REPLICA", "ADDRESS", "NODE", "SESSIONS", "STATE", "ENGINE", "MODEL", "DTYPE", "KV TOKENS", "METRICS")
    ]
    for r in sorted(status.replicas, key=lambda r: (r.kind != "verifier", r.name)):
        rows.append(
            (
                r.kind,
                r.name,
                r.address,
                r.node[:12] or "-",
                str(r.sessions),
                "lost" if r.lost else "draining" if r.draining else "serving",
                r.engine or "-",
                r.architecture or "-",
                r.dtype or "-",
                _kv_use(r),
                r.metrics_address or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    for kind in ("verifier", "drafter"):
        serving = sum(1 for r in status.replicas if r.kind == kind and not r.draining and not r.lost)
        policy = status.autoscale.get(kind)
        print(f"{kind}s: {serving} serving" + (f", autoscaling min:max:target_sessions {policy}" if policy else ""))
    limit = f" of {status.max_active_requests}" if status.max_active_requests else ""
    print(
        f"active requests: {status.active_requests}{limit}" + ("" if status.scalable else "  (fixed pools: not on Ray)")
    )
    if len(status.orchestrators) > 1:
        print_orchestrators(status)
    elif status.metrics_address:
        print(f"orchestrator metrics: {status.metrics_address}  (all targets: specd metrics-targets)")
    for model, names in _models(status.replicas).items():
        print(f"model {model}: {', '.join(names)}")
    for r in status.replicas:
        if r.engine == "hf":
            print(
                f"note: {r.name} runs the Hugging Face fallback engine for {r.model_type or r.architecture} "
                "(slower than lean; docs/models.md)"
            )


def _models(replicas) -> dict[str, list[str]]:
    """Each model the replicas loaded (repo id at its commit, or directory) -> their names."""
    out: dict[str, list[str]] = {}
    for r in sorted(replicas, key=lambda r: (r.kind != "verifier", r.name)):
        if r.model:
            out.setdefault(r.model, []).append(r.name)
    return out


def print_orchestrators(status) -> None:
    """A line per orchestrator: all serve one address, each takes the
    connections the kernel hands it and admits up to its share of the limit."""
    rows = [("ORCHESTRATOR", "ADDRESS", "NODE", "PID", "REQUESTS", "STATE", "METRICS")]
    for o in status.orchestrators:
        rows.append(
            (
                o.name + (" (owner)" if o.owner else ""),
                o.address,
                o.node[:12] or "-",
                str(o.pid),
                f"{o.active_requests}/{o.max_active_requests}",
                "draining" if o.draining else "serving",
                o.metrics_address or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"answered by {status.answered_by}  (all Prometheus targets: specd metrics-targets)")


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


def cmd_demo(args) -> int:
    args.port = 0
    args.http_port = 0  # one generation over gRPC: no HTTP API, no fixed port to find taken
    if cmd_up(args, print_address=False) != 0:
        return 1
    try:
        print(args.prompt, end="")
        return cmd_generate(args)
    finally:
        cmd_down(args)


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
        channel_args = None if args.address is None else _client_channel(args, args.address)
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
        metadata = _auth(args)
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


def _add_deploy_flags(p) -> None:
    p.add_argument(
        "--target", default=str(DEMO_TARGET), help="target model: a dir or a Hugging Face repo id (default: the demo)"
    )
    p.add_argument(
        "--drafter",
        help="drafter model: a dir or a Hugging Face repo id (default: the config's `model`, else the demo drafter; "
        "'' = none)",
    )
    add_model_flags(p)
    add_exposure_flags(p)
    p.add_argument("--verifiers", type=int, default=1, help="verifier replicas")
    p.add_argument("--drafters", type=int, default=1, help="drafter replicas")
    p.add_argument(
        "--orchestrators",
        type=int,
        default=1,
        help="orchestrator processes serving the one Generate / HTTP address on this node (SO_REUSEPORT: "
        "the kernel spreads client connections over them; a connection stays on one)",
    )
    p.add_argument(
        "--max-active-requests",
        type=int,
        default=1024,
        help="concurrent Generate streams of the deployment, split evenly over the orchestrators; "
        "past its share an orchestrator answers RESOURCE_EXHAUSTED",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "auto"],
        help="model weights dtype in every replica (auto: the checkpoint's own)",
    )
    p.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "lean", "hf"],
        help="every replica's forward: auto = lean where the model is supported, else hf",
    )
    p.add_argument(
        "--kv-cache-memory",
        default="auto",
        help="each replica's KV cache budget: bytes (512MiB, 4GiB) or a fraction in (0, 1] of the "
        "memory free after loading its weights (auto: 0.85 on CUDA, 0.5 on a CPU)",
    )
    p.add_argument("--kv-block-size", type=int, default=64, help="tokens per block of the KV budget")
    p.add_argument(
        "--replica-gpus", type=float, default=0.0, help="GPUs each replica asks Ray for (1 on GPU pools; 0 = CPU)"
    )
    p.add_argument(
        "--autoscale-verifiers",
        metavar="MIN:MAX:TARGET",
        help="autoscale the verifier pool: about TARGET sessions per replica, MIN..MAX replicas",
    )
    p.add_argument("--autoscale-drafters", metavar="MIN:MAX:TARGET", help="autoscale the drafter pool likewise")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds a replica may take to serve (scaling onto a new GPU node takes minutes)",
    )
    p.add_argument("--ray-address", help="attach to this Ray cluster (default: $RAY_ADDRESS, else start one)")
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
    p.add_argument("--replica-host", help="interface the replicas listen on (default: each one's Ray node IP)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="every actor's Prometheus /metrics port on its node (default 0: any free port; "
        "a fixed port fits only one specd actor per node)",
    )
    p.add_argument(
        "--metrics-targets-file",
        metavar="PATH",
        help="Prometheus file_sd JSON of every /metrics endpoint, kept up to date by the orchestrator "
        f"(default: $SPECD_HOME/{TARGETS_FILE_NAME}, SPECD_HOME defaulting to ~/.specd)",
    )
    add_tls_flags(p, server=True)


def _add_client_flags(p) -> None:
    """How the client commands reach the orchestrator: TLS and the bearer token."""
    p.add_argument("--token", help=f"bearer token for the public API (default: ${CLIENT_TOKEN_ENV})")
    add_tls_flags(p, server=False)


def _add_generate_flags(p) -> None:
    p.add_argument("--address", help="Generate address (default: the one `specd up` printed)")
    p.add_argument("--token", help=f"bearer token for the public API (default: ${CLIENT_TOKEN_ENV})")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def _add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="what speculation buys on your pair and prompts: off vs on, per concurrency level",
        description="Runs the prompts at each concurrency level with speculation off and on, in alternating "
        "rounds; writes a JSON report and a PNG plot (docs/bench.md).",
    )
    b.add_argument("--address", help="benchmark this running orchestrator (default: start a local stack)")
    b.add_argument(
        "--target", default=str(DEMO_TARGET), help="local stack: target dir or repo id (org/name[@rev]; default: demo)"
    )
    b.add_argument("--drafter", default=str(DEMO_DRAFTER), help="local stack: drafter dir or repo id (default: demo)")
    b.add_argument("--allow-pickle-weights", action="store_true", help="local stack: see `specd up --help`")
    b.add_argument("--device", default="auto", help="local stack: auto | cpu | cuda")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    b.add_argument(
        "--prompts",
        metavar="FILE",
        help='JSONL, one {"prompt": "..."} or {"messages": [...]} a line (default: the demo\'s held-out prompts)',
    )
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="streams in flight")
    b.add_argument("--methods", nargs="+", default=["draft_model"], choices=METHODS, help="speculative methods")
    b.add_argument("--k", type=int, nargs="+", default=[4], help="draft lengths (a chain setting per method and K)")
    b.add_argument(
        "--tree", type=parse_branching, metavar="B1,B2,...", help="also a tree setting: children per depth, e.g. 2,2,1"
    )
    b.add_argument(
        "--settings", metavar="FILE", help="JSON/YAML list of GenerateRequest field dicts (instead of the flags)"
    )
    b.add_argument("--rounds", type=int, default=3, help="rounds per level, the settings' order reversed every other")
    b.add_argument(
        "--requests", type=int, help="requests per setting, level and round (default: max(prompts, 2 x level))"
    )
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--request-timeout", type=float, default=600.0, help="seconds per Generate")
    b.add_argument("--out", default="bench.json", help="JSON report")
    b.add_argument("--plot", default="bench.png", help="PNG plot ('' = none; needs matplotlib: the bench extra)")
    _add_client_flags(b)
    b.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="distributed speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start (or attach to) Ray and deploy; prints the Generate address")
    _add_deploy_flags(up)
    up.add_argument("--port", type=int, default=50051, help="public Generate port (0 = any free)")
    add_http_flags(up)
    add_speculative_flags(up)
    up.set_defaults(func=cmd_up)
    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt", help="the prompt text; with --chat, the user's message")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message, rendered with the target's chat template (instruct models)",
    )
    gen.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's")
    _add_generate_flags(gen)
    add_tls_flags(gen, server=False)
    g = gen.add_argument_group("per-request speculation (default: the service's config)")
    g.add_argument("--method", choices=METHODS, help="draft_model | eagle | ngram | off")
    g.add_argument("--num-speculative-tokens", type=int, help="K for this request (0 = off)")
    add_draft_shape_flags(g)
    gen.set_defaults(func=cmd_generate)
    status = sub.add_parser(
        "status", help="pools, replicas, orchestrators, their nodes, addresses, sessions (of every orchestrator)"
    )
    status.add_argument("--address", help="orchestrator address (default: the one `specd up` printed)")
    status.add_argument("--timeout", type=float, default=10.0)
    _add_client_flags(status)
    status.set_defaults(func=cmd_status)
    scale = sub.add_parser(
        "scale", help="resize the drafter and/or verifier pool, or the orchestrators, live (down = drain)"
    )
    scale.add_argument("--drafters", type=int, help="serving drafter replicas wanted")
    scale.add_argument("--verifiers", type=int, help="serving verifier replicas wanted")
    scale.add_argument(
        "--orchestrators",
        type=int,
        help="orchestrators serving the one address (down: the removed ones stop listening and leave "
        "when their running streams have ended)",
    )
    scale.add_argument("--address", help="orchestrator address (default: the one `specd up` printed)")
    scale.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for new replicas")
    _add_client_flags(scale)
    scale.set_defaults(func=cmd_scale)
    targets = sub.add_parser(
        "metrics-targets", help="every Prometheus /metrics endpoint as file_sd JSON (from the orchestrator's status)"
    )
    targets.add_argument("--address", help="orchestrator address (default: the one `specd up` printed)")
    targets.add_argument("--timeout", type=float, default=10.0)
    _add_client_flags(targets)
    targets.set_defaults(func=cmd_metrics_targets)
    down = sub.add_parser("down", help="stop what `specd up` started")
    down.set_defaults(func=cmd_down)
    demo = sub.add_parser("demo", help="up, one generation with the demo pair, down")
    _add_deploy_flags(demo)
    _add_generate_flags(demo)
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    add_speculative_flags(demo)
    demo.set_defaults(func=cmd_demo, max_new_tokens=64)
    _add_bench_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

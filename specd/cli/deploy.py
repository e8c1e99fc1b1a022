"""`specd up`, `specd down` and `specd demo`: a deployment on Ray, from the
flags (specd/deploy_config.py) to the address it serves."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path

from orchestrator.spec_config import DRAFTER_METHODS, ConfigError, SpeculativeConfig
from specd import ray_cluster
from specd.cli.client import cmd_generate
from specd.demo import DEMO_DRAFTER, DEMO_EAGLE
from specd.deploy_config import TARGETS_FILE_NAME, DeploymentConfig
from specd_core.net.auth import tokens_from_env_and_file
from specd_core.net.exposure import check_exposure
from specd_core.net.flags import config_from_args
from specd_core.net.security import SecurityConfigError
from specd_core.runtime.hub import ModelPair, ModelSpecError, resolve_pair


def cmd_up(args, print_address: bool = True) -> int:
    if ray_cluster.read_state():
        print("specd is already up (run `specd down` first); state: " + str(ray_cluster.state_path()), file=sys.stderr)
        return 1
    try:
        cfg, exposure_warning = _check_up_flags(args)
    except (ConfigError, SecurityConfigError, OSError, ValueError) as exc:
        print(f"specd up: {exc}", file=sys.stderr)
        return 2
    problem = _choose_drafter(args, cfg.speculative) or _pair_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if exposure_warning:
        print(f"specd up: {exposure_warning}", file=sys.stderr)
    cfg = _with_models(cfg, args.models)
    try:
        ray_address, ray_pid = _ray_cluster(args)
        address = _deploy_on_ray(cfg, ray_address, ray_pid).replace("0.0.0.0", "127.0.0.1")
        http = _http_address() if cfg.http_port else ""
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
            "metrics_targets_file": cfg.metrics_targets_file,
            "http": http,
        }
    )
    if print_address:  # stdout carries only the address, for scripts
        print(address)
    print(f"specd is up: Generate at {address} (ray {ray_address})", file=sys.stderr)
    if http:
        print(f"OpenAI-compatible HTTP API at {http}/v1", file=sys.stderr)
    return 0


def _check_up_flags(args) -> tuple[DeploymentConfig, str | None]:
    """The deployment's config from the flags (its models chosen and resolved
    later), every flag checked before Ray starts: the speculative config,
    autoscaling policies, KV budget, certificates and tokens (with the file
    named), who can reach the API. With it, the warning --insecure beyond
    loopback prints (what is exposed), if any."""
    from specd_core.runtime.kv_budget import parse_memory

    parse_memory(args.kv_cache_memory)  # a ValueError naming the value, before Ray starts
    if not 1 <= args.orchestrators <= args.max_active_requests:
        raise ValueError(
            f"--orchestrators must be in [1, --max-active-requests ({args.max_active_requests})], "
            f"got {args.orchestrators}"
        )
    cfg = config_from_args(
        DeploymentConfig,
        args,
        target_dir=args.target,
        drafter_dir=None,
        auth_tokens_file=str(Path(args.auth_tokens_file).resolve()) if args.auth_tokens_file else None,
        metrics_targets_file=_targets_file(args),
    )
    if cfg.tls:
        cfg.tls.check(server=True)
    tokens = tokens_from_env_and_file(cfg.auth_tokens_file)
    warning = check_exposure(cfg.host, cfg.tls, bool(tokens), cfg.insecure)
    _check_targets_file(cfg.metrics_targets_file)
    return cfg, warning


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
    can run); args.models: both resolved (a repo id to its directory in the
    Hugging Face cache). Returns what is wrong with the models, if anything."""
    if sc.method in ("eagle3", "medusa") and args.drafter is None and not sc.model:  # no demo head of these
        what = "an EAGLE-3 head" if sc.method == "eagle3" else "Medusa heads"
        return f"specd up: method {sc.method} needs {what}: --drafter HEAD_DIR (or the speculative config's model)"
    drafter = (
        args.drafter
        if args.drafter is not None
        else (sc.model or str(DEMO_EAGLE if sc.method == "eagle" else DEMO_DRAFTER))
    )
    args.drafter = drafter or None
    try:
        args.models = resolve_pair(
            args.target, args.drafter, args.target_revision, args.drafter_revision, args.allow_pickle_weights
        )
    except ModelSpecError as exc:
        return f"specd up: {exc}"
    args.target, args.drafter = args.models.target.path, args.models.drafter and args.models.drafter.path
    if sc.method in DRAFTER_METHODS and not args.drafter:
        return f"specd up: speculative_config.method is {sc.method} but no drafter is given"
    return None


def _with_models(cfg: DeploymentConfig, models: ModelPair) -> DeploymentConfig:
    """The deployment's models: their directories here, and what each replica
    resolves on its own node (a repo id pinned to the commit resolved here)."""
    return dataclasses.replace(
        cfg,
        target_dir=models.target.path,
        drafter_dir=models.drafter.path if models.drafter else None,
        target_model=models.target.spec,
        drafter_model=models.drafter.spec if models.drafter else "",
    )


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


def _deploy_on_ray(cfg: DeploymentConfig, ray_address: str, ray_pid: int | None) -> str:
    """Deploy the replicas and the orchestrator; the orchestrator's address.
    A failure leaves nothing running: deploy() kills the actors it started,
    this driver disconnects, and the local Ray cluster we started stops - in
    that order: a driver still connected when its cluster's head is stopped
    waits for the head at exit ("Failed to connect to GCS within 60 seconds")
    instead of exiting with the error."""
    import ray

    from specd.ray_deploy import deploy

    try:
        ray.init(address=ray_address, namespace="specd", logging_level=logging.WARNING, log_to_driver=False)
        return deploy(cfg, warn=lambda line: print(line, file=sys.stderr))
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

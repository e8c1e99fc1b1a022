"""Starting, attaching to and stopping the Ray cluster `specd up` runs on.

`specd up` attaches to an existing cluster when given one (RAY_ADDRESS or
--ray-address); otherwise it starts a local head with `ray start --head --block`
in its own process group, so that `specd down` stops exactly that cluster and
nothing else on the machine (`ray stop` would kill every Ray on the host).

Every cluster started here uses Ray's token authentication (`ray_env`): whoever
reaches a Ray port can otherwise run code in the cluster. The one `specd up`
starts for itself also listens on loopback only (`loopback=True`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Ray's token authentication: every process of the cluster (its own, the
# workers, each driver) must run with the mode set and find the token.
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_FILE_NAME = "ray_auth_token"
# Ray rewrites a node address of 127.0.0.1 to the machine's routable address
# (services.resolve_ip_for_localhost) unless it believes clusters are off, the
# mode it keeps for laptops (ray_constants.ENABLE_RAY_CLUSTER): then every
# listener binds 127.0.0.1. Multi-node clusters refuse this mode, so it is for
# the one-machine cluster `specd up` starts, never for one a worker joins.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# Enough pool capacity for a one-machine deployment; real clusters declare these
# per node type (deploy/cluster.yaml).
LOCAL_RESOURCES = {"drafter": 64, "verifier": 64}


def state_path() -> Path:
    return Path(os.environ.get("SPECD_HOME", Path.home() / ".specd")) / "state.json"


def read_state() -> dict | None:
    p = state_path()
    return json.loads(p.read_text()) if p.exists() else None


def write_state(state: dict) -> None:
    p = state_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(state, indent=2))


def clear_state() -> None:
    state_path().unlink(missing_ok=True)


def free_ports(n: int, host: str = "127.0.0.1", family: int = socket.AF_INET) -> list[int]:
    """n distinct free ports on `host` (of address `family`): every socket
    stays bound until all are drawn, so no port comes twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(family, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def ensure_token(path: Path) -> Path:
    """The cluster's token file, made (256 random bits, mode 0600) if missing;
    an existing one is kept but locked down to its owner."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    os.chmod(path, 0o600)
    return path


def ray_env(token_path: Path | str, loopback: bool) -> dict[str, str]:
    """The environment every process of the cluster needs, its drivers' too
    (`use_ray_env`): token authentication with this token, and loopback."""
    env = {RAY_AUTH_MODE_ENV: "token", RAY_AUTH_TOKEN_PATH_ENV: str(token_path)}
    if loopback:
        env[RAY_LOOPBACK_ENV] = "0"
    return env


def use_ray_env(env: dict[str, str]) -> None:
    """Make this process a driver of a cluster started with `env`. Ray reads
    the auth mode into its native config and the cluster mode into a constant
    when it is imported; a process that already imported it has both
    refreshed here (as Ray's own `ray.init` does when it turns auth on)."""
    os.environ.update(env)
    if "ray" in sys.modules:
        from ray._private import ray_constants
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # compiled, no stubs

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()  # another cluster's token may be cached
        ray_constants.ENABLE_RAY_CLUSTER = env.get(RAY_LOOPBACK_ENV) != "0"


def ray_executable() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def start_local_ray(
    timeout_s: float = 90.0,
    log_dir: str | None = None,
    resources: dict | None = None,
    num_cpus: int | None = None,
    loopback: bool = True,
) -> tuple[str, int]:
    """Start a head node; return (address, pid of its process group leader).
    Its token is `token_file(log_dir)`; drivers need `ray_env(that, loopback)`.
    loopback=False: Ray's own choice of address (the machine's routable one),
    for a head that other nodes join."""
    home = Path(log_dir or state_path().parent)
    env = ray_env(ensure_token(token_file(home)), loopback)
    # Ray's client server otherwise takes port 10001, which a second cluster on
    # the machine would find taken; its dashboard agent takes 52365, inside the
    # range free ports come from, and Ray refuses to start a head whose GCS
    # port drew the same number. All three drawn together, so none repeats.
    port, client_port, agent_port = free_ports(3)
    cmd = [
        ray_executable(),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--resources={json.dumps(LOCAL_RESOURCES if resources is None else resources)}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--ray-client-server-port={client_port}",
        f"--dashboard-agent-listen-port={agent_port}",
    ]
    cmd += [f"--num-cpus={num_cpus}"] if num_cpus is not None else []
    cmd += ["--node-ip-address=127.0.0.1"] if loopback else []
    address = f"127.0.0.1:{port}"  # without loopback, Ray's drivers rewrite it to the node's address
    pid = _spawn(cmd, home / "ray-head.log", env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise RuntimeError(f"`ray start` exited; see {home / 'ray-head.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return address, pid
        except OSError:
            time.sleep(0.5)
    stop_local_ray(pid)
    raise TimeoutError(f"Ray head did not come up on {address} within {timeout_s}s")


def token_file(home: Path | str) -> Path:
    """Where the token of a cluster started with this home / log dir lives."""
    return Path(home) / TOKEN_FILE_NAME


def start_private_ray() -> tuple[str, int]:
    """The cluster `specd up` starts for itself: loopback only, its token in
    SPECD_HOME; this process becomes its driver (`use_ray_env`)."""
    address, pid = start_local_ray()
    use_ray_env(ray_env(token_file(state_path().parent), loopback=True))
    return address, pid


def start_worker_node(
    address: str,
    resources: dict,
    log_path: Path,
    num_cpus: int = 1,
    object_store_mb: int = 100,
    token_path: Path | None = None,
) -> int:
    """Join one more node to the cluster at `address` with `ray start --block`;
    return its process group id. Several nodes may share this machine (a
    multi-node cluster on one host, for tests): each gets its own free agent and
    metrics ports, which Ray otherwise fixes and two nodes would both claim.
    The caller waits for the node to register (e.g. by polling ray.nodes()).
    token_path: the cluster's token (default: the one in log_path's directory)."""
    flags = (
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
    )
    ports = dict(zip(flags, free_ports(len(flags))))
    cmd = [
        ray_executable(),
        "start",
        "--block",
        f"--address={address}",
        f"--resources={json.dumps(resources)}",
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={object_store_mb * 1024 * 1024}",
        "--disable-usage-stats",
    ] + [f"--{flag}={port}" for flag, port in ports.items()]
    return _spawn(cmd, log_path, ray_env(token_path or token_file(log_path.parent), loopback=False))


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str]) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **env}
        ).pid


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie leader still "exists": ask whether it has exited.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == 0


def stop_local_ray(pid: int, timeout_s: float = 2.0) -> None:
    """SIGTERM the `ray start --block` process group, then SIGKILL what is left
    (`ray start --block` itself and its monitor do not always exit on SIGTERM)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            _reap(pid)
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.3)


def _reap(pid: int) -> None:
    """Collect `pid`'s exit status if it is this process's child and has exited:
    until then the zombie leader keeps its process group signalable, and a stop
    waiting for the group to go would wait out its whole timeout."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)

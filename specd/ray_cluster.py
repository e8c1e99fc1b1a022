"""Starting, attaching to and stopping the Ray cluster `specd up` runs on.

`specd up` attaches to an existing cluster when given one (RAY_ADDRESS or
--ray-address); otherwise it starts a local head with `ray start --head --block`
in its own process group, so that `specd down` stops exactly that cluster and
nothing else on the machine (`ray stop` would kill every Ray on the host).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_executable() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def start_local_ray(
    timeout_s: float = 90.0, log_dir: str | None = None, resources: dict | None = None, num_cpus: int | None = None
) -> tuple[str, int]:
    """Start a head node; return (address, pid of its process group leader)."""
    port = free_port()
    cmd = [
        ray_executable(),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--resources={json.dumps(LOCAL_RESOURCES if resources is None else resources)}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    cmd += [f"--num-cpus={num_cpus}"] if num_cpus is not None else []
    address = f"127.0.0.1:{port}"
    pid = _spawn(cmd, Path(log_dir or state_path().parent) / "ray-head.log")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise RuntimeError(f"`ray start` exited; see {Path(log_dir or state_path().parent) / 'ray-head.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return address, pid
        except OSError:
            time.sleep(0.5)
    stop_local_ray(pid)
    raise TimeoutError(f"Ray head did not come up on {address} within {timeout_s}s")


def start_worker_node(
    address: str, resources: dict, log_path: Path, num_cpus: int = 1, object_store_mb: int = 100
) -> int:
    """Join one more node to the cluster at `address` with `ray start --block`;
    return its process group id. Several nodes may share this machine (a
    multi-node cluster on one host, for tests): each gets its own free agent and
    metrics ports, which Ray otherwise fixes and two nodes would both claim.
    The caller waits for the node to register (e.g. by polling ray.nodes())."""
    ports = {
        flag: free_port()
        for flag in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
        )
    }
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
    return _spawn(cmd, log_path)


def _spawn(cmd: list[str], log_path: Path) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True).pid


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


def stop_local_ray(pid: int, timeout_s: float = 5.0) -> None:
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

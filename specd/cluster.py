"""Starting, attaching to and stopping the Ray cluster `specd up` runs on.

`specd up` attaches to an existing cluster when given one (RAY_ADDRESS or
--ray-address); otherwise it starts a local head with `ray start --head --block`
in its own process group, so that `specd down` stops exactly that cluster and
nothing else on the machine (`ray stop` would kill every Ray on the host).
"""
from __future__ import annotations

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


def start_local_ray(timeout_s: float = 90.0, log_dir: str | None = None) -> tuple[str, int]:
    """Start a head node; return (address, pid of its process group leader)."""
    port = free_port()
    cmd = [ray_executable(), "start", "--head", "--block", f"--port={port}",
           f"--resources={json.dumps(LOCAL_RESOURCES)}", "--include-dashboard=false",
           "--disable-usage-stats"]
    log_path = Path(log_dir or state_path().parent) / "ray-head.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start` exited with {proc.returncode}; see {log.name}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return address, proc.pid
        except OSError:
            time.sleep(0.5)
    stop_local_ray(proc.pid)
    raise TimeoutError(f"Ray head did not come up on {address} within {timeout_s}s")


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
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.3)

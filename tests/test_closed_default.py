"""Closed by default, on a machine with a network interface besides loopback.

(a) A plain `specd up` (the demo pair; free ports only so that it cannot
collide with another run): every socket its Ray cluster's processes listen on
- GCS, raylet, object manager, client server, agents, the replica and
orchestrator actors (Generate, HTTP, metrics) - is a loopback one, and
Generate and the HTTP API serve on 127.0.0.1. The cluster takes only its own
token: a driver without it, or with another, fails to connect with Ray's
authentication error, and so does a Ray Client call; with it, a driver runs a
task. `specd down` leaves no process of the cluster behind.

(b) `specd up --host 0.0.0.0` with bearer tokens, the models given as repo
ids from a hand-built Hugging Face cache (offline), the target pinned to a
commit other than its `main`: Generate and the HTTP API listen on every
interface, answer UNAUTHENTICATED / 401 without the token, and with it serve
exactly the pinned target's own greedy output; `specd status` names each
replica's repo id and commit."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from specd import ray_cluster
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.auth import bearer_metadata
from specd_core.net.grpc_util import open_channel
from specd_core.runtime.models import load_model
from tests.hf_cache import add_snapshot, offline_env
from tests.listening import is_loopback, listening, session_pids
from tests.test_greedy_exact import MAX_NEW, assert_same_or_near_tie, reference

pytestmark = pytest.mark.cluster

SPECD = [sys.executable, "-m", "specd"]
DRIVER = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print(ray.get(ray.remote(lambda: 42).remote()))"


def clean_env(home: Path, **extra) -> dict:
    """This environment without any Ray address or auth setting, and a HOME
    of its own (Ray also looks for a token in ~/.ray)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "SPECD_HOME": str(home), "HOME": str(home), **extra}


def specd(args, env, timeout=300):
    return subprocess.run(SPECD + args, env=env, capture_output=True, text=True, timeout=timeout)


def ray_client_port(rows) -> int:
    for pid, _, _, _, port in rows:
        try:
            if b"ray.util.client.server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return port
        except OSError:
            continue
    raise AssertionError(f"no Ray client server among {rows}")


def client_ping(port: int, token: str | None):
    """Ray Client's ClusterInfo call, with or without the cluster's token."""
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
        return ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
            request, timeout=30, metadata=bearer_metadata(token))


def test_plain_up_is_loopback_only_and_its_ray_takes_only_its_token(tmp_path):
    home = tmp_path / "home"
    env = clean_env(home)
    up = specd(["up", "--port", "0", "--http-port", "-1"], env)
    assert up.returncode == 0, up.stderr
    state = json.loads((home / "state.json").read_text())
    try:
        address, http = state["address"], state["http"]
        assert up.stdout.strip() == address and address.startswith("127.0.0.1:"), up.stdout
        assert http.startswith("http://127.0.0.1:"), http
        rows = listening(session_pids(state["ray_pid"]))
        print("\n".join(" ".join(map(str, r)) for r in rows))  # -s shows what listens
        assert len(rows) >= 8, rows  # GCS, raylet (2), client server, agents, actors
        assert [r for r in rows if not is_loopback(r[3])] == [], rows
        bound = {(ip, port) for _, _, _, ip, port in rows}
        assert ("127.0.0.1", int(address.rsplit(":", 1)[1])) in bound
        assert ("127.0.0.1", int(http.rsplit(":", 1)[1])) in bound
        # Both APIs serve there.
        with open_channel(address) as channel:
            last = list(pb_grpc.OrchestratorServiceStub(channel).Generate(
                pb.GenerateRequest(prompt="def f(x):", max_new_tokens=4), timeout=120))[-1]
        assert last.finish_reason, last
        assert urllib.request.urlopen(f"{http}/v1/models", timeout=30).status == 200
        # The token: made for this cluster, readable by its owner only.
        token_path = home / ray_cluster.TOKEN_FILE_NAME
        assert token_path.stat().st_mode & 0o777 == 0o600
        token = token_path.read_text().strip()
        # Drivers: no token, a wrong token, the token. The loopback setting is
        # given to all three, so that only the token differs.
        # A driver the cluster refuses retries its first GCS call for about 20 s
        # (Ray's NUM_REDIS_GET_RETRIES, one try a second) before it reports the
        # refusal; the same refusal comes on every try, so three are plenty.
        loopback = {ray_cluster.RAY_LOOPBACK_ENV: "0", "RAY_NUM_REDIS_GET_RETRIES": "3"}
        drivers = {
            "none": clean_env(home, **loopback),
            "wrong": clean_env(home, **loopback, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64),
            "token": clean_env(home, **ray_cluster.ray_env(token_path, loopback=True)),
        }
        procs = {k: subprocess.Popen([sys.executable, "-c", DRIVER, state["ray_address"]], env=e, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for k, e in drivers.items()}
        out = {k: (p.communicate(timeout=180)[0], p.returncode) for k, p in procs.items()}
        for k in ("none", "wrong"):
            text, rc = out[k]
            assert rc != 0 and "42" not in text.split(), text
            assert "Unauthenticated" in text and "InvalidAuthToken" in text, text
        assert out["token"][1] == 0 and out["token"][0].split()[-1] == "42", out["token"][0]
        # Ray Client (how remote jobs reach a cluster without its dashboard).
        port = ray_client_port(rows)
        with pytest.raises(grpc.RpcError) as denied:
            client_ping(port, None)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED, denied.value
        with pytest.raises(grpc.RpcError) as denied:
            client_ping(port, "0" * 64)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED, denied.value
        client_ping(port, token)
    finally:
        down = specd(["down"], env)
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 30
    while session_pids(state["ray_pid"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert session_pids(state["ray_pid"]) == []


def test_up_by_repo_id_beyond_loopback_needs_the_token(pairs, tmp_path):
    target, drafter = pairs["llama"]
    hf = tmp_path / "hf"
    pinned, newer = "a" * 40, "b" * 40
    # main points at another model (the drafter's weights): serving the target's
    # greedy output shows the pinned commit was the one loaded.
    add_snapshot(hf, "org/target", pinned, Path(target), refs=())
    add_snapshot(hf, "org/target", newer, Path(drafter), refs=("main",))
    add_snapshot(hf, "org/drafter", pinned, Path(drafter))
    (tmp_path / "tokens").write_text("s3cret\n")
    home = tmp_path / "home"
    env = clean_env(home, **offline_env(hf))
    refused = specd(["up", "--host", "0.0.0.0", "--target", "org/target", "--drafter", "org/drafter"], env)
    assert refused.returncode == 2 and "refusing to serve Generate and the HTTP API on 0.0.0.0" in refused.stderr
    assert not (home / "state.json").exists()
    up = specd(["up", "--host", "0.0.0.0", "--auth-tokens-file", str(tmp_path / "tokens"), "--port", "0",
                "--http-port", "-1", "--target", "org/target", "--target-revision", pinned,
                "--drafter", "org/drafter"], env)
    assert up.returncode == 0, up.stderr
    state = json.loads((home / "state.json").read_text())
    try:
        address, http = state["address"], state["http"]
        port, http_port = int(address.rsplit(":", 1)[1]), int(http.rsplit(":", 1)[1])
        rows = listening(session_pids(state["ray_pid"]))
        assert {port, http_port} <= {p for _, _, _, ip, p in rows if ip in ("0.0.0.0", "::")}, rows
        prompt = AutoTokenizer.from_pretrained(target)("def f(x):\n    return")["input_ids"]
        request = pb.GenerateRequest(prompt_token_ids={"ids": prompt}, max_new_tokens=MAX_NEW)
        with open_channel(address) as channel:
            stub = pb_grpc.OrchestratorServiceStub(channel)
            with pytest.raises(grpc.RpcError) as denied:
                list(stub.Generate(request, timeout=60))
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            got = [t for r in stub.Generate(request, timeout=120, metadata=bearer_metadata("s3cret"))
                   for t in r.token_ids]
        with pytest.raises(urllib.error.HTTPError) as http_denied:
            urllib.request.urlopen(f"{http}/v1/models", timeout=30)
        assert http_denied.value.code == 401
        want, gaps = reference(load_model(target), prompt)
        other, _ = reference(load_model(drafter), prompt)
        assert other != want  # main's model would have answered differently
        assert_same_or_near_tie(got, want, gaps, "pinned org/target")
        status = specd(["status", "--token", "s3cret"], env)
        assert status.returncode == 0, status.stderr
        assert f"org/target@{pinned}" in status.stdout and f"org/drafter@{pinned}" in status.stdout, status.stdout
    finally:
        down = specd(["down"], env)
    assert down.returncode == 0, down.stderr

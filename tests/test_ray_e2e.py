"""End to end through real processes - a Ray cluster, drafter and
verifier gRPC servers as Ray actors on real ports, a client calling Generate over
the network - and `specd up` / `specd generate` / `specd status` / `specd scale` / `specd down` from a shell.
The `specd up` deployment runs mutual TLS on every link and bearer tokens, so the
certificate paths are shown to reach the replica actors. Every actor serves
Prometheus /metrics, listed in the orchestrator's file_sd targets file, which
follows the pools (a restarted replica's new port, a scale-up). (`specd demo`,
which starts and stops a Ray cluster of its own, is tests/test_demo_pair.py's.)"""
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.request

import httpx2
import openai
import pytest
import ray

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.auth import bearer_metadata
from specd_core.net.grpc_util import open_channel
from specd_core.net.security import TlsConfig
from specd_core.runtime.models import load_model
from tests.certs import make_pki
from tests.test_greedy_exact import reference

pytestmark = pytest.mark.cluster

SPECD = [sys.executable, "-m", "specd"]


def run(args, env, timeout=300):
    return subprocess.run(SPECD + args, env=env, capture_output=True, text=True, timeout=timeout)


def scrape(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def sample(text: str, name: str) -> float:
    """An unlabelled sample's value in a /metrics text (0 when absent)."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def listed(targets_file) -> dict:
    """specd_replica -> (specd_kind, target) of the file_sd JSON file."""
    groups = json.loads(targets_file.read_text())
    assert all(g["labels"]["job"] == "specd" and len(g["targets"]) == 1 for g in groups), groups
    return {g["labels"]["specd_replica"]: (g["labels"]["specd_kind"], g["targets"][0]) for g in groups}


def test_specd_up_generate_down_on_ray(ray_cluster, pairs, tmp_path):
    target, drafter = pairs["llama"]
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "tokens").write_text("ray-token\n")
    env = dict(os.environ, RAY_ADDRESS=ray_cluster, SPECD_HOME=str(tmp_path / "home"), SPECD_TOKEN="ray-token")
    # Replicas and the orchestrator are dialled by Ray node IP, which the test
    # certificate does not list: the name `localhost` is checked instead.
    tls = ["--tls-ca", pki.ca, "--tls-server-name", "localhost"]
    up = run(["up", "--target", target, "--drafter", drafter, "--drafters", "2", "--port", "0", "--http-port", "-1",
              "--tls-cert", pki.server_cert,
              "--tls-key", pki.server_key, "--tls-client-auth", "--auth-tokens-file", str(tmp_path / "tokens"),
              *tls], env)
    assert up.returncode == 0, up.stderr
    address = up.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"[\d.]+:\d+", address), up.stdout
    try:
        # The replicas are Ray actors in the cluster, each serving gRPC itself.
        ray.init(address=ray_cluster, namespace="specd", logging_level="WARNING")
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert {"specd-orchestrator", "specd-verifier-0", "specd-drafter-0", "specd-drafter-1"} <= names
        ray.shutdown()
        # The Prometheus targets file, in $SPECD_HOME by default: every actor.
        targets_file = tmp_path / "home" / "prometheus_targets.json"
        assert {name: kind for name, (kind, _) in listed(targets_file).items()} == {
            "specd-orchestrator": "orchestrator", "specd-verifier-0": "verifier",
            "specd-drafter-0": "drafter", "specd-drafter-1": "drafter"}

        # A client over the network: the stream equals target-only greedy decoding.
        prompt = [40, 41, 42, 43, 44, 45]
        want, _ = reference(load_model(target, "cpu"), prompt)
        client_tls = TlsConfig(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, server_name="localhost")
        with open_channel(address, client_tls) as ch:
            chunks = list(pb_grpc.OrchestratorServiceStub(ch).Generate(
                pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=prompt), max_new_tokens=len(want),
                                   num_speculative_tokens=3), timeout=120, metadata=bearer_metadata("ray-token")))
        assert len(chunks) > 1  # streamed, not one blob
        assert [t for c in chunks for t in c.token_ids] == want
        assert chunks[-1].finish_reason in ("length", "stop") and chunks[-1].stats.cycles > 0
        # Every target of the file serves its metrics; they counted that stream.
        scraped = {name: scrape(target) for name, (_, target) in listed(targets_file).items()}
        assert all("# TYPE specdec:active_sessions gauge" in text for text in scraped.values())
        assert sample(scraped["specd-verifier-0"], "specdec:spec_decode_num_drafts_total") == chunks[-1].stats.drafts
        assert 'specdec:generation_tokens_total{method="draft_model"}' in scraped["specd-orchestrator"]

        # The OpenAI-compatible API of the orchestrator actor, as `specd up` reported it (stderr):
        # mTLS and the token too. Dialled on loopback, a name the certificate lists.
        http = re.search(r"OpenAI-compatible HTTP API at https://[\d.]+:(\d+)/v1", up.stderr)
        assert http, up.stderr
        ctx = ssl.create_default_context(cafile=pki.ca)
        ctx.load_cert_chain(pki.client_cert, pki.client_key)
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{http.group(1)}/v1", api_key="ray-token",
                               http_client=httpx2.Client(verify=ctx, timeout=120), max_retries=0)
        r = client.completions.create(model=os.path.basename(target), prompt=prompt, max_tokens=len(want),
                                      temperature=0, extra_body={"num_speculative_tokens": 3})
        assert r.usage.completion_tokens == len(want) and r.choices[0].model_extra["speculative_decoding_stats"]
        client.close()

        check_drafter_restart(ray_cluster, address, prompt, want, client_tls, bearer_metadata("ray-token"),
                              targets_file)

        tls += ["--tls-cert", pki.client_cert, "--tls-key", pki.client_key]
        check_status_and_scale_metrics(env, tls, targets_file)
        gen = run(["generate", "def add(a, b):", "--max-new-tokens", "12", *tls], env, timeout=120)
        assert gen.returncode == 0, gen.stderr
        assert "finish=length" in gen.stderr and "completion_tokens=12" in gen.stderr
        tree = run(["generate", "def add(a, b):", "--max-new-tokens", "12", "--tree", "2,2,1", *tls], env,
                   timeout=120)
        assert tree.returncode == 0 and gen.stdout == tree.stdout, tree.stderr   # greedy: same text
        assert "K=3" in tree.stderr
        bad = run(["generate", "x", "--temperature", "-1", *tls], env, timeout=120)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
        no_cert = run(["generate", "x", *tls[:4]], env, timeout=120)         # mTLS: refused
        assert no_cert.returncode == 1 and "UNAVAILABLE" in no_cert.stderr
        wrong = run(["generate", "x", *tls, "--token", "not-it"], env, timeout=120)
        assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr
    finally:
        down = run(["down"], env)
    assert down.returncode == 0, down.stderr
    assert json.loads(targets_file.read_text()) == []      # nothing left for Prometheus to scrape
    ray.init(address=ray_cluster, namespace="specd", logging_level="WARNING")
    try:
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        assert not [n for n in left if n.startswith("specd-")]
    finally:
        ray.shutdown()


def check_drafter_restart(ray_cluster, address, prompt, want, client_tls, metadata, targets_file):
    """Replica loss on Ray: the drafter's process is killed; the next stream finds it
    lost and moves to the other drafter (still exact); Ray restarts the actor
    (max_restarts), its servers on new ports, which the orchestrator re-discovers
    (and lists in the targets file); then streams speculate on it again (its own
    counters, from zero in the new process, say so)."""
    import signal
    import time
    ray.init(address=ray_cluster, namespace="specd", logging_level="WARNING")
    try:
        pid = ray.get(ray.get_actor("specd-drafter-0").pid.remote(), timeout=60)
    finally:
        ray.shutdown()
    os.kill(pid, signal.SIGKILL)
    with open_channel(address, client_tls) as ch:
        stub, admin = pb_grpc.OrchestratorServiceStub(ch), pb_grpc.AdminServiceStub(ch)

        def status():
            return {r.name: r for r in admin.Status(pb.StatusRequest(), timeout=30, metadata=metadata).replicas}
        before = {name: r.address for name, r in status().items()}
        old_metrics = status()["specd-drafter-0"].metrics_address
        assert listed(targets_file)["specd-drafter-0"] == ("drafter", old_metrics)

        def generate():
            chunks = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=prompt),
                                        max_new_tokens=len(want), num_speculative_tokens=3,
                                        pipeline_drafting=False), timeout=120,
                                        metadata=metadata))
            assert [t for c in chunks for t in c.token_ids] == want
            return chunks[-1].stats
        # The drafter's process is gone (or restarting at a new port): found lost,
        # the stream runs as plain decoding, still exact.
        generate()
        drafter = status()["specd-drafter-0"]
        assert drafter.lost or drafter.address != before["specd-drafter-0"]
        deadline = time.monotonic() + 120          # the restart loads the model again
        while drafter.lost or drafter.address == before["specd-drafter-0"]:
            assert time.monotonic() < deadline, f"drafter not re-discovered: {drafter}"
            time.sleep(0.5)
            drafter = status()["specd-drafter-0"]
        # Listed at its new metrics port (written when it was re-discovered).
        assert drafter.metrics_address and drafter.metrics_address != old_metrics
        assert listed(targets_file)["specd-drafter-0"] == ("drafter", drafter.metrics_address)
        stats = generate()
        assert stats.accepted_tokens > 0           # speculating on the restarted drafter
        # The least-loaded tie goes to the first drafter: the restarted process proposed them
        # (nothing drafted ahead: each proposal was verified).
        assert sample(scrape(drafter.metrics_address), "specdec:spec_decode_num_drafts_total") == stats.drafts


def check_status_and_scale_metrics(env, tls, targets_file):
    """`specd status` lists the metrics endpoints; `specd scale --drafters 3`
    adds a drafter the targets file lists (and that serves its metrics);
    `specd metrics-targets` prints the file's list from the orchestrator's Status."""
    status = run(["status", *tls], env, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "METRICS" in status.stdout
    for name, (_, target) in listed(targets_file).items():
        line = "orchestrator metrics: " if name == "specd-orchestrator" else name
        assert any(line in row and target in row for row in status.stdout.splitlines()), (name, status.stdout)
    scale = run(["scale", "--drafters", "3", *tls], env)
    assert scale.returncode == 0, scale.stderr
    now = listed(targets_file)
    assert sorted(n for n, (kind, _) in now.items() if kind == "drafter") == [
        "specd-drafter-0", "specd-drafter-1", "specd-drafter-2"]
    assert "# TYPE specdec:active_sessions gauge" in scrape(now["specd-drafter-2"][1])
    printed = run(["metrics-targets", *tls], env, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout) == json.loads(targets_file.read_text())


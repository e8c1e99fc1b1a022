"""Live scaling on a real multi-node Ray cluster on one machine:
a head (no pool resource) plus worker nodes started with `ray start`, two
offering `drafter` (2 and 1 units), two offering `verifier` (one unit each, so a
second verifier MUST go to the second verifier node).

- Placement: every replica runs on a node of its own pool.
- Live scaling with long Generate streams running: drafters 1 -> 3 -> 1 and
  verifiers 1 -> 2 -> 1 with `specd scale`. No stream breaks, every greedy
  output equals target-only decoding, new sessions go to the new replicas, and
  a drained replica is seen draining with live sessions and leaves only after
  they end (a replica killed early would break its streams: no failover here).
  Each stream runs freely until 200 tokens short of its end, then waits for the
  test (tests/held_stream.py), so no machine is fast enough to end it early.
"""
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specd import ray_cluster
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_model, load_tokenizer
from tests.held_stream import HeldStream
from tests.test_greedy_exact import assert_same_or_near_tie
from tests.tiny_models import build_model, build_perturbed_drafter, build_tokenizer, corpus_lines

pytestmark = pytest.mark.cluster

SPECD = [sys.executable, "-m", "specd"]
# Tokens per stream. Each holds 200 short of its end until released, so the
# streams are open through every scale step whatever their length; they are
# long enough to be still decoding, not yet held, when the first step starts.
LONG, SHORT = 1200, 800


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """A tiny llama pair with room for long streams (4k context) and no EOS, so
    every stream runs its full length (a random model may say EOS anywhere)."""
    from transformers import AutoConfig
    root = tmp_path_factory.mktemp("long")
    tok = build_tokenizer(root / "tokenizer")
    target = build_model(root / "target", "llama", "target", 11, tok, logit_scale=15.0, context=4096)
    config = AutoConfig.from_pretrained(target)
    config.eos_token_id = None
    config.save_pretrained(target)
    (root / "target" / "generation_config.json").unlink(missing_ok=True)   # it repeats the EOS id
    return target, build_perturbed_drafter(target, root / "drafter", noise=0.3)


@pytest.fixture
def multinode(tmp_path, attach_ray):
    """head + drafter nodes D1, D2 + verifier nodes V1, V2; yields (address, {node_id: pool})."""
    address, head = ray_cluster.start_local_ray(log_dir=str(tmp_path), resources={}, num_cpus=1, loopback=False)
    attach_ray(tmp_path)  # the nodes join with the head's token (in tmp_path)
    groups = [head]
    pools = {}
    try:
        for i, (pool, units) in enumerate([("drafter", 2), ("drafter", 1), ("verifier", 1), ("verifier", 1)]):
            groups.append(ray_cluster.start_worker_node(address, {pool: units}, tmp_path / f"node-{i}.log"))
            # One at a time: nodes joining at once on one host race for ports.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                alive = _nodes(address)
                if len(alive) == i + 2:
                    break
                time.sleep(1)
            assert len(alive) == i + 2, f"node {i} did not join; see {tmp_path}/node-{i}.log"
        pools = {nid: next((p for p in ("drafter", "verifier") if p in res), "head") for nid, res in alive.items()}
        yield address, pools
    finally:
        with ThreadPoolExecutor(len(groups)) as pool:      # each stop waits for its node to exit
            list(pool.map(ray_cluster.stop_local_ray, reversed(groups)))


def _nodes(address) -> dict:
    import json
    out = subprocess.run([sys.executable, "-c", (
        "import ray, json; ray.init(address=%r, logging_level='ERROR');"
        "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))") % address],
        capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}


def specd(args, env, timeout=600):
    return subprocess.run(SPECD + args, env=env, capture_output=True, text=True, timeout=timeout)


def status(address) -> list:
    with grpc.insecure_channel(address) as ch:
        return list(pb_grpc.AdminServiceStub(ch).Status(pb.StatusRequest(), timeout=10).replicas)


T0 = time.monotonic()


def progress(streams, what, addr=None):
    load = {r.name: r.sessions for r in status(addr)} if addr else ""
    print(f"[{time.monotonic() - T0:6.1f}s] {what}: stream tokens {[len(s.tokens) for s in streams]} {load}",
          flush=True)


def wait_for(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def greedy_check(model, prompt, got):
    """What target-only greedy decoding would have given where `got` (a
    stream's tokens) is its own prefix, and the top-2 logit gaps there: from
    one forward over prompt + got. Token by token this is model.generate's
    greedy reference up to `got`'s first divergence, the only place
    assert_same_or_near_tie looks past, for a fraction of the cost of decoding
    thousands of tokens one at a time."""
    import torch
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1:]
    top2 = torch.topk(logits, 2, dim=-1).values
    return logits.argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def test_pools_on_their_nodes_and_live_scaling(multinode, long_pair, tmp_path):
    address_ray, pools = multinode
    target, drafter = long_pair
    env = dict(os.environ, RAY_ADDRESS=address_ray, SPECD_HOME=str(tmp_path / "home"))
    up = specd(["up", "--target", target, "--drafter", drafter, "--port", "0", "--http-port", "0",
                "--num-speculative-tokens", "3"], env)
    assert up.returncode == 0, up.stderr
    addr = up.stdout.strip().splitlines()[-1]
    tok = load_tokenizer(target)
    lines = [l for l in corpus_lines() if len(l.strip()) > 30]
    prompts = [tok(lines[i * 37])["input_ids"] for i in range(8)]
    streams, release = [], threading.Event()

    def Stream(address, prompt, max_new):     # held open until the scale-down has been seen
        return HeldStream(address, prompt, max_new, release)

    try:
        def placed_right():
            for r in status(addr):
                assert pools[r.node] == r.kind, f"{r.name} runs on a {pools[r.node]} node"
        placed_right()

        # Long streams on drafter-0 / verifier-0.
        streams += [Stream(addr, p, LONG) for p in prompts[:3]]
        wait_for(lambda: all(s.tokens for s in streams[:3]), "first tokens of the long streams")

        progress(streams, 'drafters 1 -> 3', addr)
        # Drafters 1 -> 3: the Scale call returns once the new replicas serve.
        out = specd(["scale", "--drafters", "3"], env)
        assert out.returncode == 0, out.stderr
        drafters = [r for r in status(addr) if r.kind == "drafter"]
        assert len(drafters) == 3 and not any(r.draining for r in drafters)
        placed_right()
        assert len({r.node for r in drafters}) == 2        # 3 units over the two drafter nodes
        # New sessions go to the new (least loaded) replicas.
        new_d = {r.name for r in drafters if r.name != "specd-drafter-0"}
        streams += [Stream(addr, p, LONG) for p in prompts[3:5]]
        wait_for(lambda: all(s.tokens for s in streams[3:5]), "first tokens of the new streams")
        by_name = {r.name: r for r in status(addr)}
        assert all(by_name[n].sessions >= 1 for n in new_d), by_name

        progress(streams, 'verifiers 1 -> 2', addr)
        # Verifiers 1 -> 2: V1 is full, so the new one must land on V2.
        out = specd(["scale", "--verifiers", "2"], env)
        assert out.returncode == 0, out.stderr
        verifiers = [r for r in status(addr) if r.kind == "verifier"]
        assert len(verifiers) == 2 and len({r.node for r in verifiers}) == 2
        placed_right()
        new_v = next(r.name for r in verifiers if r.name != "specd-verifier-0")
        streams.append(Stream(addr, prompts[5], SHORT))
        wait_for(lambda: streams[-1].tokens, "first tokens on the new verifier")
        assert {r.name: r for r in status(addr)}[new_v].sessions == 1

        progress(streams, 'down again', addr)
        # Down again: drained replicas keep serving their sessions, then leave.
        out = specd(["scale", "--drafters", "1", "--verifiers", "1"], env)
        assert out.returncode == 0, out.stderr
        now = {r.name: r for r in status(addr)}
        draining = {n for n, r in now.items() if r.draining}
        assert len(draining) == 3, now                    # two drafters and one verifier
        assert new_v in draining and any(now[n].sessions > 0 for n in draining), now
        assert _named_actors(address_ray) >= draining     # still alive while serving
        progress(streams, 'drained; releasing the streams', addr)
        release.set()
        for s in streams:
            s.join(900)
        wait_for(lambda: not any(r.draining for r in status(addr)), "drained replicas to leave", 30)
        left = {r.name for r in status(addr)}
        assert left == {"specd-verifier-0", "specd-drafter-0"}, left
        assert not (draining & _named_actors(address_ray)), "drained replicas still running"
    finally:
        release.set()
        for s in streams:
            s.join(900)
        down = specd(["down"], env)
    assert down.returncode == 0, down.stderr

    model = load_model(target, "cpu")
    for i, s in enumerate(streams):
        assert s.error is None, f"stream {i} broke: {s.error}"
        assert len(s.tokens) == s.max_new, f"stream {i}: {len(s.tokens)} tokens"    # no EOS in this model
        want, gaps = greedy_check(model, s.prompt, s.tokens)
        assert_same_or_near_tie(s.tokens, want, gaps, f"stream {i}")


def _named_actors(address) -> set:
    out = subprocess.run([sys.executable, "-c", (
        "import ray; ray.init(address=%r, logging_level='ERROR');"
        "print(' '.join(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)))") % address],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())

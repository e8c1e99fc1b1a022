"""`specd up` when something fails at start: the cause reaches the terminal in
a line or two (no traceback wall, no "Failed to connect to GCS within 60
seconds" from a driver whose cluster was stopped under it), the exit code is
non-zero, and nothing is left running - no state file, no Ray cluster it
started, no specd actor on a cluster it attached to.

(a) a pair whose tokenizers differ: refused before Ray starts; (b) a drafter
whose weights are corrupt: only the replica actor finds out, on its own local
Ray; (c) an error only the orchestrator actor finds (method eagle with a
draft-model drafter), on an attached cluster after the replicas started."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import ray
from transformers import AutoTokenizer

pytestmark = pytest.mark.cluster

SPECD = [sys.executable, "-m", "specd"]


def up(args, home, ray_address=None, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["SPECD_HOME"] = str(home)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    start = time.monotonic()
    r = subprocess.run(SPECD + ["up", "--port", "0", "--http-port", "0", *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return r, time.monotonic() - start


def assert_short_error(r, cause: str):
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr and "GCS" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("specd up:")]
    assert len(errors) == 1 and re.search(cause, errors[0]), r.stderr
    assert len(lines) <= 3, r.stderr  # the error, and "started a local Ray cluster" if it did
    assert r.stdout == ""  # stdout carries only an address, on success


def processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


def test_incompatible_pair_is_refused_before_ray_starts(pairs, tmp_path):
    target, drafter = pairs["llama"]
    other = tmp_path / "other-drafter"
    shutil.copytree(drafter, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.eos_token = tok.convert_ids_to_tokens(7)
    tok.save_pretrained(other)
    r, took = up(["--target", target, "--drafter", str(other)], tmp_path / "home")
    assert_short_error(r, "cannot draft for target .* the eos token differs")
    assert r.returncode == 2 and took < 60
    assert not (tmp_path / "home").exists()  # no state, no Ray log: nothing was started


def test_a_replica_failing_at_start_reaches_the_terminal(pairs, tmp_path):
    target, drafter = pairs["llama"]
    corrupt = tmp_path / "corrupt-drafter"
    shutil.copytree(drafter, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    home = tmp_path / "home"
    r, _ = up(["--target", target, "--drafter", str(corrupt)], home)
    assert_short_error(r, f"drafter replica specd-drafter-0 \\({corrupt}\\) failed to start: \\w+")
    assert not (home / "state.json").exists()
    port = re.search(r"started a local Ray cluster at [\d.]+:(\d+)", r.stderr).group(1)
    deadline = time.monotonic() + 15
    while processes_mentioning(f":{port}") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(f":{port}")  # its GCS, raylet and workers are gone


def test_an_orchestrator_failing_at_start_leaves_no_actor(pairs, tmp_path, ray_cluster):
    target, drafter = pairs["llama"]
    r, _ = up(["--target", target, "--drafter", drafter, "--method", "eagle"], tmp_path / "home", ray_cluster)
    assert_short_error(r, "the orchestrator failed to start: ValueError: speculative_config.method is eagle")
    assert not (tmp_path / "home" / "state.json").exists()
    ray.init(address=ray_cluster, namespace="specd", logging_level="WARNING")
    try:
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    finally:
        ray.shutdown()
    assert not [n for n in left if n.startswith("specd-")], left  # the replicas that did start are gone too

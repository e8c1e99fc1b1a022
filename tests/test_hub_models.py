"""Models by Hugging Face repo id (specd_core/runtime/hub.py), offline against
a cache built by hand (tests/hf_cache.py), and the Hub's refusals from a
stand-in server (HF_ENDPOINT): every failure is one line naming the model and
exit status 2 before anything starts (no Ray, no state file). Pickle-only
weights are refused unless --allow-pickle-weights, with which they serve
exactly the target's own greedy output."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.local_stack import Stack
from specd_core.runtime.models import load_model
from tests.hf_cache import add_snapshot, offline_env
from tests.test_greedy_exact import MAX_NEW, assert_same_or_near_tie, reference

pytestmark = pytest.mark.services

SPECD = [sys.executable, "-m", "specd"]
COMMIT = "1" * 40


def run(cmd, env_extra, home, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "HF_"))}
    env.update(env_extra, SPECD_HOME=str(home))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_refused(r, home, pattern: str):
    """Exit 2, the reason in one line, nothing started."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and pattern in lines[0], r.stderr
    assert not (home / "state.json").exists() and not (home / "ray-head.log").exists()


@pytest.fixture(scope="module")
def hub_cache(pairs, tmp_path_factory):
    """org/target and org/drafter (the llama pair) at COMMIT, and org/pickled:
    the target with its weights as pytorch_model.bin only."""
    target, drafter = pairs["llama"]
    root = tmp_path_factory.mktemp("hf")
    add_snapshot(root, "org/target", COMMIT, Path(target))
    add_snapshot(root, "org/drafter", COMMIT, Path(drafter))
    pickled = tmp_path_factory.mktemp("pickled") / "target"
    pickled.mkdir()
    model = AutoModelForCausalLM.from_pretrained(target)
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")  # save_pretrained writes only safetensors
    AutoTokenizer.from_pretrained(target).save_pretrained(pickled)
    assert not list(pickled.glob("*.safetensors")) and list(pickled.glob("*.bin"))
    add_snapshot(root, "org/pickled", COMMIT, pickled)
    return root, pickled


class FakeHub(BaseHTTPRequestHandler):
    """The Hub's answers (status and X-Error-Code, as huggingface.co sends them)
    for a repo that does not exist, a gated one and a missing revision."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if "/org/gated" in self.path:
            code, error = 401, "GatedRepo"
        elif "/revision/nope" in self.path:
            code, error = 404, "RevisionNotFound"
        else:
            code, error = 404, "RepoNotFound"
        body = json.dumps({"error": error}).encode()
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_each_hub_failure_is_one_line_and_exit_2(hub_cache, fake_hub, tmp_path):
    root, _ = hub_cache
    online = {"HF_HOME": str(tmp_path / "empty-cache"), "HF_ENDPOINT": fake_hub, "HF_HUB_OFFLINE": "0"}
    cases = [
        (["--target", "org/absent"], online, "--target org/absent: no such repo on the Hugging Face Hub"),
        (["--target", "org/gated"], online, "--target org/gated: a gated repo; accept its terms"),
        (["--target", "org/target", "--target-revision", "nope"], online, "--target org/target@nope: the repo has no revision nope"),
        (["--target", "org/absent"], offline_env(root), "--target org/absent: not in the Hugging Face cache"),
        (["--target", "org/target@" + "2" * 40], offline_env(root), "not in the Hugging Face cache"),
        (["--target", "org/pickled", "--drafter", ""], offline_env(root),
         "--target org/pickled: only pickle weights (pytorch_model.bin), no safetensors: pickle weights can run code"),
    ]
    for i, (args, env, pattern) in enumerate(cases):
        home = tmp_path / f"home-{i}"
        assert_refused(run(SPECD + ["up", *args], env, home), home, pattern)


def test_a_pickle_only_model_is_refused_by_the_service_and_by_specd_up(hub_cache, tmp_path):
    _, pickled = hub_cache
    r = run([sys.executable, "-m", "verifier_svc", "--model", str(pickled)], {}, tmp_path)
    assert r.returncode == 2 and "only pickle weights (pytorch_model.bin), no safetensors" in r.stderr, r.stderr
    assert "--allow-pickle-weights" in r.stderr
    home = tmp_path / "home"
    assert_refused(run(SPECD + ["up", "--target", str(pickled), "--drafter", ""], {}, home), home,
                   "only pickle weights (pytorch_model.bin)")


def test_a_pickle_only_target_serves_with_the_opt_in_exactly_as_greedy(hub_cache, pairs):
    """The verifier loads the pickle-only copy of the target (--allow-pickle-weights);
    the output is the target's own greedy continuation."""
    _, pickled = hub_cache
    target, drafter = pairs["llama"]
    prompt = AutoTokenizer.from_pretrained(target)("def f(x):\n    return")["input_ids"]
    want, gaps = reference(load_model(target), prompt)
    stack = Stack(str(pickled), drafter, ("--allow-pickle-weights",))
    try:
        got, _ = stack.generate(prompt_token_ids={"ids": prompt}, max_new_tokens=MAX_NEW)
    finally:
        stack.stop()
    assert_same_or_near_tie(got, want, gaps, "pickle-only target")

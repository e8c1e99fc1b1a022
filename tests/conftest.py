import os

import pytest

from specd.ops.local_stack import Stack
from tests.tiny_models import build_pair, build_perturbed_drafter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
FAMILIES = ["llama", "qwen2"]


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def pairs(model_root):
    """family -> (target_dir, drafter_dir); the drafter is the target plus noise,
    so drafts are sometimes accepted and sometimes not."""
    out = {}
    for family in FAMILIES:
        target, _ = build_pair(model_root, family)
        out[family] = (target, build_perturbed_drafter(target, model_root / f"{family}-noisy", noise=0.3))
    return out


@pytest.fixture(scope="session")
def stacks(pairs):
    """family -> running Stack (real processes on real ports)."""
    running = {}
    try:
        for family, (target, drafter) in pairs.items():
            running[family] = Stack(target, drafter)
        yield running
    finally:
        for s in running.values():
            s.stop()


@pytest.fixture(scope="session")
def metered(pairs):
    """A llama Stack with Prometheus endpoints (batching and memory tests)."""
    target, drafter = pairs["llama"]
    stack = Stack(target, drafter, metrics=True)
    yield stack
    stack.stop()

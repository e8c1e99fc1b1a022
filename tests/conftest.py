import os

import pytest

from specd.ops.local_stack import Stack
from tests.tiny_models import build_pair, build_perturbed_drafter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
FAMILIES = ["llama", "qwen2"]

# Every test declares what it needs to run, with exactly one of these markers
# (declared in pyproject.toml; tests/README.md says what each tier holds).
# `statistical` is not a tier: it is added to distribution tests of any tier.
TIERS = ("unit", "services", "cluster")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Refuse a test without exactly one tier marker, before any -m selection:
    an unmarked test would otherwise run only in the full suite and silently
    drop out of every tier."""
    bad = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) != 1:
            bad.append(f"  {item.nodeid}: {', '.join(tiers) if tiers else 'no tier marker'}")
    if bad:
        raise pytest.UsageError(
            f"each test needs exactly one tier marker of {', '.join(TIERS)} "
            "(a module-level `pytestmark` or a per-test mark):\n" + "\n".join(bad))


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

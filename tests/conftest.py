import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specd import ray_cluster as local_ray
from specd.local_stack import Stack
from tests.tiny_models import build_pair, build_perturbed_drafter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process (this one and every service, CLI and Ray
# process the tests start, which inherit the variable): the tiny test models
# gain nothing from torch's thread pool, and several processes each spinning a
# thread per core only contend for the cores. Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
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
    # Under pytest-xdist (scripts/test.sh runs two workers with --dist
    # loadgroup), a module's tests stay on one worker, so its module fixtures
    # start once and its tests run in their order; the cluster tier runs on one
    # worker, one test at a time: two Ray heads on one machine would contend
    # for Ray's fixed default ports (client server, dashboard agent).
    for item in items:
        group = "ray" if item.get_closest_marker("cluster") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


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
    # Started and stopped together: each start spends seconds importing and
    # loading, each stop waits for its processes to drain and exit.
    with ThreadPoolExecutor(len(pairs)) as pool:
        started = {family: pool.submit(Stack, target, drafter) for family, (target, drafter) in pairs.items()}
    running = {family: f.result() for family, f in started.items() if f.exception() is None}
    try:
        for f in started.values():
            f.result()  # the first failure to start, if any
        yield running
    finally:
        with ThreadPoolExecutor(len(pairs)) as pool:
            list(pool.map(Stack.stop, running.values()))


@pytest.fixture(scope="session")
def metered(pairs):
    """A llama Stack with Prometheus endpoints (batching, cancellation, fuzzing,
    memory and metrics tests: each leaves it with no session open)."""
    target, drafter = pairs["llama"]
    stack = Stack(target, drafter, metrics=True)
    yield stack
    stack.stop()


@pytest.fixture
def attach_ray(monkeypatch):
    """attach(home): make this process, and those it starts, drivers of the
    cluster whose token is in `home` (token authentication, as every cluster
    specd starts); undone after the test."""
    def attach(home) -> None:
        env = local_ray.ray_env(local_ray.token_file(home), loopback=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        local_ray.use_ray_env(env)  # this process imported Ray already
    return attach


@pytest.fixture
def ray_cluster(tmp_path, attach_ray):
    """A local Ray head (`ray start`) for one test; its address, as RAY_ADDRESS
    takes it. Like a cluster a user attaches to: on the machine's address (not
    loopback only), with token authentication; the test process and what it
    starts carry the token (`attach_ray`)."""
    address, pid = local_ray.start_local_ray(log_dir=str(tmp_path), loopback=False)
    attach_ray(tmp_path)
    try:
        yield address
    finally:
        local_ray.stop_local_ray(pid)

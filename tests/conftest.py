import atexit
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specd import local_stack
from specd import ray_cluster as local_ray
from specd.local_stack import Stack
from tests import zygote
from tests.tiny_models import build_pair, build_perturbed_drafter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process (this one and every service, CLI and Ray
# process the tests start, which inherit the variable): the tiny test models
# gain nothing from torch's thread pool, and several processes each spinning a
# thread per core only contend for the cores. Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
FAMILIES = ["llama", "qwen2"]

# Service processes (specd.local_stack) are forked from a zygote that has
# imported torch and transformers once (tests/zygote.py), not started as fresh
# interpreters that each import them: the same servers, minutes less CPU per
# suite. SPECD_TEST_ZYGOTE=0 starts fresh interpreters, as users' processes are.
if os.environ.get("SPECD_TEST_ZYGOTE", "1") != "0":
    _zygote = zygote.Zygote()
    local_stack.launch = _zygote.launch
    atexit.register(_zygote.close)

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
    # start once and its tests run in their order; the cluster tier is one
    # group, one test at a time: two Ray heads on one machine would contend
    # for Ray's fixed default ports (client server, dashboard agent), and its
    # tests share one head (`ray_head`). Modules that are the only users of a
    # session stack share a group too (SHARED_STACK_GROUPS), so that it starts
    # once, not once per worker.
    groups = {}
    for item in items:
        groups[item] = group_of(item)
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    ranks: dict[str, tuple[int, int]] = {}
    for item, group in groups.items():
        ranks[group] = min(ranks.get(group, (3, 0)), group_rank(group, item))
    # The groups in the order the workers take them (scripts/test.sh passes
    # --no-loadscope-reorder; xdist's own order is by number of tests): the
    # longest first, the many short unit modules last, where they fill the
    # gap while the other worker finishes its last group (the longest-first
    # rule for two machines). The sort is stable: a group's tests keep their
    # order, and a group's tests stay together (also without xdist, so that
    # module fixtures start once).
    # Within the ray group, the tests on the shared head (ray_cluster) last and
    # one after the other, so that the head is started once.
    items.sort(key=lambda item: (ranks[groups[item]], groups[item] == "ray" and "ray_cluster" in item.fixturenames))


# Modules that alone use a session stack: one xdist group each, so the stack
# starts once per run (under xdist every worker has its own session).
SHARED_STACK_GROUPS = {
    "tests/test_http_api.py": "http_stack",
    "tests/test_http_structured.py": "http_stack",
    "tests/test_batching.py": "metered",
    "tests/test_cancellation.py": "metered",
    "tests/test_fuzz_rpc.py": "metered",
    "tests/test_memory.py": "metered",
    "tests/test_metrics.py": "metered",
}
# The longest groups, roughly longest first (tests/README.md); they start
# before the rest. The cluster tier ("ray", one group of several minutes) is
# handed out once the longest services groups have been: it then runs beside
# the other worker's shorter modules, and still ends well before the suite.
LONGEST_FIRST = (
    "metered", "tests/test_sampling_lossless.py", "tests/test_family_services.py", "http_stack", "ray",
    "tests/test_adaptive_cold_start.py", "tests/test_structured_lossless.py", "tests/test_overload.py",
    "tests/test_pipeline.py", "tests/test_eagle.py", "tests/test_greedy_exact.py", "tests/test_padded_pairs.py",
)


# The long pure statistical modules (each a good part of the unit tier),
# handed out first within it. Those whose tests share no module fixture have
# each test a group of its own, spread over both workers, instead of one
# module holding a worker to the end of `--fast` while the other idles
# (test_confidence.py keeps its module: its drafter cores are module fixtures).
LONG_UNIT = ("tests/test_acceptance.py", "tests/test_confidence.py", "tests/test_tree.py")
SPLIT_BY_TEST = ("tests/test_acceptance.py", "tests/test_tree.py")


def group_of(item) -> str:
    if item.get_closest_marker("cluster"):
        return "ray"
    module = item.nodeid.split("::")[0]
    if module in SPLIT_BY_TEST:
        return item.nodeid
    return SHARED_STACK_GROUPS.get(module, module)


def group_rank(group: str, item) -> tuple[int, int]:
    """Where `item` would put its group in the schedule (the group takes its
    lowest): the longest groups in their order, then groups with a services
    test, then the rest (unit), the long statistical ones first."""
    if group in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(group))
    if item.get_closest_marker("services"):
        return (1, 0)
    return (2, 0 if item.nodeid.split("::")[0] in LONG_UNIT else 1)


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


class LazyStacks(dict):
    """family -> running Stack, each started on its first use: most modules use
    only the llama stack, and a start costs each of its three processes
    seconds of CPU (importing torch and transformers). Thread-safe: a first
    use may come from a test's thread pool."""

    def __init__(self, pairs):
        super().__init__()
        self.pairs = pairs
        self.lock = threading.Lock()

    def __missing__(self, family):
        with self.lock:
            if not dict.__contains__(self, family):
                self[family] = Stack(*self.pairs[family])
            return dict.__getitem__(self, family)


@pytest.fixture(scope="session")
def stacks(pairs):
    """family -> running Stack (real processes on real ports), started on first use."""
    running = LazyStacks(pairs)
    yield running
    # Stopped together: each stop waits for its processes to drain and exit.
    with ThreadPoolExecutor(max(1, len(running))) as pool:
        list(pool.map(Stack.stop, list(running.values())))


@pytest.fixture(scope="session")
def metered(pairs):
    """A llama Stack with Prometheus endpoints (batching, cancellation, fuzzing,
    memory and metrics tests: each leaves it with no session open)."""
    target, drafter = pairs["llama"]
    stack = Stack(target, drafter, metrics=True)
    yield stack
    stack.stop()


# The chat template of the HTTP stack's target (tests/test_http_api.py's chat tests).
HTTP_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="session")
def http_stack(pairs, tmp_path_factory):
    """A llama Stack serving the OpenAI-compatible HTTP API, with metrics, whose
    target carries a chat template (HTTP_CHAT_TEMPLATE; the model is named
    "llama-chat" after its directory): tests/test_http_api.py and
    tests/test_http_structured.py (one xdist group, SHARED_STACK_GROUPS)."""
    from specd_core.runtime.models import load_tokenizer

    target, drafter = pairs["llama"]
    chat_target = tmp_path_factory.mktemp("http") / "llama-chat"
    shutil.copytree(target, chat_target)
    tok = load_tokenizer(str(chat_target))
    tok.chat_template = HTTP_CHAT_TEMPLATE
    tok.save_pretrained(str(chat_target))
    stack = Stack(str(chat_target), drafter, metrics=True, http=True)
    yield stack
    stack.stop()


# The local Ray head the cluster tests that attach to one share: (address,
# process group) while it runs. A head costs seconds of CPU to start and stop
# (GCS, raylet, workers); its users are scheduled one after the other (ray
# group, schedule_rank) and it is stopped after the last of them, because the
# other cluster tests start heads of their own (`specd demo`, `specd up`
# without an address, a multi-node cluster), which would contend with it for
# Ray's fixed default ports.
_RAY_HEAD: dict = {}


@pytest.fixture
def up_without_ray(tmp_path, monkeypatch) -> list:
    """`specd up` in a unit test: SPECD_HOME under tmp_path, and the step that
    would start or reach Ray records its arguments and fails instead. The list
    it returns fills when a `specd up` got that far (a refusal before Ray
    leaves it empty)."""
    from specd.cli import deploy

    monkeypatch.setenv("SPECD_HOME", str(tmp_path / "home"))
    deployed: list = []

    def no_ray(args):
        deployed.append(args)
        raise RuntimeError("no Ray in a unit test")

    monkeypatch.setattr(deploy, "_ray_cluster", no_ray)
    monkeypatch.setattr(local_ray, "start_private_ray", no_ray)
    return deployed


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
def ray_cluster(request, tmp_path_factory, attach_ray):
    """The shared local Ray head (`ray start`); its address, as RAY_ADDRESS takes
    it. Like a cluster a user attaches to: on the machine's address (not
    loopback only), with token authentication; the test process and what it
    starts carry the token (`attach_ray`). Each user leaves it as it found it
    (`specd down`, or a refused `specd up` that cleans up after itself, which
    these tests check); after a test that failed, any specd actor it left is
    killed, so that the next test does not inherit it."""
    if not _RAY_HEAD:
        home = tmp_path_factory.mktemp("ray-head")
        address, pid = local_ray.start_local_ray(log_dir=str(home), loopback=False)
        _RAY_HEAD.update(address=address, pid=pid, home=home)
    attach_ray(_RAY_HEAD["home"])
    yield _RAY_HEAD["address"]
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        kill_specd_actors(_RAY_HEAD["address"])


def kill_specd_actors(address: str) -> None:
    import ray

    ray.init(address=address, logging_level="ERROR")
    try:
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["name"].startswith("specd-"):
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    finally:
        ray.shutdown()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call = report  # ray_cluster reads whether its test failed
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared Ray head once its last consecutive user is torn down."""
    yield
    if _RAY_HEAD and (nextitem is None or "ray_cluster" not in nextitem.fixturenames):
        local_ray.stop_local_ray(_RAY_HEAD.pop("pid"))
        _RAY_HEAD.clear()

"""The KV budget (specd_core/runtime/kv_budget.py): parsing --kv-cache-memory, the
block pool's accounting (also under threads), lean and Hugging Face sessions
taking and giving back blocks, the cores refusing what does not fit while
other sessions go on, and --dtype auto."""
import threading

import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd.cli import DEMO_DRAFTER
from specd_core.errors import CapacityExceeded
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.kv_budget import DEFAULT_FRACTION, KVPool, budget_bytes, parse_memory
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.models import Runner, SessionCache, checkpoint_dtype, load_model
from specd_core.runtime.propose_call import ProposeCall
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()


@pytest.mark.parametrize("text, want", [
    ("512MiB", (512 * 2**20, None)), ("4GiB", (4 * 2**30, None)), ("4gib", (4 * 2**30, None)),
    ("1000000", (1_000_000, None)), ("2GB", (2 * 10**9, None)), ("1.5KiB", (1536, None)), ("0B", (0, None)),
    ("0.5", (None, 0.5)), (".25", (None, 0.25)), ("1", (None, 1.0)), ("1.0", (None, 1.0)),
    ("auto", (None, None)), ("", (None, None)),
])
def test_parse_memory(text, want):
    assert parse_memory(text) == want


@pytest.mark.parametrize("text", ["0", "1.5", "-1", "abc", "12XB", "0.0", "5 %"])
def test_parse_memory_refuses_nonsense(text):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory(text)


def test_budget_bytes():
    assert budget_bytes("0.25", "cpu", free=1000) == 250
    assert budget_bytes("auto", "cpu", free=1000) == int(DEFAULT_FRACTION["cpu"] * 1000)
    assert budget_bytes("3KiB", "cpu", free=1) == 3072
    assert budget_bytes("0.01", "cpu") > 0  # measured: some RAM is available here


def test_pool_accounting():
    pool = KVPool.of_bytes(10 * 64 * 100 + 99, 64, 100, "verifier")  # the partial block is not a block
    assert (pool.total_blocks, pool.block_bytes, pool.capacity_tokens) == (10, 6400, 640)
    assert pool.blocks_for(0) == 0 and pool.blocks_for(1) == 1 and pool.blocks_for(64) == 1 and pool.blocks_for(65) == 2
    assert pool.take(4) == 4
    assert pool.take(8, 2) == 6  # not all wanted, at least the needed
    assert pool.free_blocks == 0 and pool.used_tokens == 640 and pool.used_bytes == 64000
    with pytest.raises(CapacityExceeded, match=r"verifier KV budget full: X needs 1 more block.*0 of 10 are free"):
        pool.take(1, what="X")
    assert pool.used_blocks == 10  # a refusal takes nothing
    pool.give(10)
    assert pool.free_blocks == 10
    with pytest.raises(ValueError):
        pool.give(1)  # more than was taken
    with pytest.raises(ValueError):
        pool.take(1, 2)


def test_pool_under_threads():
    """Takes and gives from many threads: never more than the total in use,
    nothing lost or invented."""
    pool = KVPool(50, 8, 4)
    peak, errors = [0], []

    def worker(seed):
        held = 0
        g = torch.Generator().manual_seed(seed)
        for _ in range(2000):
            if int(torch.randint(0, 2, (1,), generator=g)) and held:
                pool.give(1)
                held -= 1
            else:
                try:
                    held += pool.take(3, 1)
                except CapacityExceeded:
                    pass
            peak[0] = max(peak[0], pool.used_blocks)
            if pool.used_blocks > pool.total_blocks:
                errors.append(pool.used_blocks)
        pool.give(held)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pool.used_blocks == 0 and peak[0] == 50


@pytest.fixture(scope="module")
def llama(pairs):
    return load_model(pairs["llama"][0], "cpu")


def test_lean_session_grows_in_blocks_within_the_pool(llama):
    lm = LeanModel(llama)
    pool = KVPool(100, 2, lm.kv_row_bytes)
    s = lm.new_session(pool=pool)
    assert s.capacity == 0 and pool.used_blocks == 0  # nothing before the prefill
    s.forward(list(range(40, 50)))  # 10 rows: 5 blocks, not the model's context
    assert (s.capacity, pool.used_blocks) == (10, 5)
    caps = [s.capacity]
    for t in range(140):
        s.forward([t % 50 + 1])
        assert s.capacity % 2 == 0 and pool.used_blocks == s.blocks and s.capacity >= s.length
        if s.capacity != caps[-1]:
            caps.append(s.capacity)
    # Geometric in blocks: each grow adds max(1 block, 25%), so 140 rows take
    # ~15 grows (copies), not one per block (70).
    for a, b in zip(caps, caps[1:]):
        assert (b - a) // 2 == max(1, (a // 2) // 4), caps
    assert len(caps) < 20, caps
    s.release()
    assert pool.used_blocks == 0 and s.capacity == 0


def test_lean_session_past_the_pool_is_unchanged(llama):
    lm = LeanModel(llama)
    pool = KVPool(5, 8, lm.kv_row_bytes)
    s = lm.new_session(pool=pool)
    s.forward(list(range(40, 80)))  # 40 rows: all 5 blocks
    before = s.kv.clone()
    with pytest.raises(CapacityExceeded, match="KV budget full"):
        s.forward([4])
    assert s.length == 40 and s.capacity == 40 and torch.equal(s.kv, before)
    s.rollback(39)
    assert torch.allclose(s.forward([79])[-1], llama(torch.tensor([list(range(40, 80))])).logits[0, -1], atol=1e-4)


def test_lean_session_takes_only_what_fits(llama):
    """When the geometric step does not fit, just the blocks needed."""
    lm = LeanModel(llama)
    pool = KVPool(21, 4, lm.kv_row_bytes)
    a, b = lm.new_session(pool=pool), lm.new_session(pool=pool)
    a.forward(list(range(40, 120)))  # 80 rows: 20 blocks
    b.forward([5, 6, 7])  # the last block
    assert pool.free_blocks == 0 and a.blocks == 20 and b.blocks == 1
    b.release()
    a.forward([8])  # 25% would be 5 blocks; one is free
    assert a.blocks == 21


def test_sessions_growing_in_turn_keep_their_blocks_in_runs(llama):
    """New sessions are placed with room after them, so that sessions growing
    in turn each take the blocks right after their own: every table stays
    one run of storage (read in place by attention, lean_step.in_place).
    Once the room is used up a session takes what is free elsewhere, and
    its table says where its last run starts."""
    lm = LeanModel(llama)
    pool = KVPool(60, 4, lm.kv_row_bytes)
    sessions = [lm.new_session(pool=pool) for _ in range(3)]
    for i, s in enumerate(sessions):
        s.forward(list(range(40 + i, 48 + i)))  # 2 blocks each
    for t in range(24):  # grow in turn: 8 + 24 rows = 8 blocks each, within the room
        for s in sessions:
            s.forward([t + 1])
    for s in sessions:
        assert s.table == list(range(s.table[0], s.table[0] + s.blocks)) and s.run_from == 0, s.table
        assert s.in_one_run(0)
    starts = sorted(s.table[0] for s in sessions)
    assert all(b - a >= 8 for a, b in zip(starts, starts[1:]))  # room between them
    first = sessions[0]
    for t in range(80):  # past the room: first runs into the next session's blocks
        first.forward([t % 50 + 1])
    assert first.run_from > 0 and not first.in_one_run(0) and first.in_one_run(first.run_from * 4)
    assert sorted(b for s in sessions for b in s.table) == sorted(set(b for s in sessions for b in s.table))
    for s in sessions:
        s.release()
    pool.check()
    assert pool.used_blocks == 0


def test_placement_uses_every_block():
    """Room is a preference: a full pool hands out every block, runs or not,
    and refuses only past its total."""
    pool = KVPool(10, 4, 8)
    got = [pool.take_blocks(1, room=8) for _ in range(3)]  # no run of 17: lowest free ids
    assert got == [[0], [1], [2]]
    assert pool.take_blocks(2, after=0) == [3, 4]  # 1 is taken: the lowest run of 2
    assert pool.take_blocks(2, after=4) == [5, 6]  # right after 4
    pool.give_blocks([1, 5])
    assert pool.take_blocks(3) == [7, 8, 9]  # a run of 3 where there is one
    assert sorted(pool.take_blocks(2)) == [1, 5]  # then the scattered ones
    with pytest.raises(CapacityExceeded):
        pool.take_blocks(1)
    pool.check()


def test_hf_session_accounts_its_rows(llama):
    pool = KVPool(3, 4, Runner(llama, "hf").kv_row_bytes)
    s = SessionCache(llama, pool)
    s.forward([1, 2, 3, 4, 5])
    assert s.blocks == 2 and pool.used_blocks == 2
    s.forward([6, 7, 8])
    assert s.blocks == 2
    with pytest.raises(CapacityExceeded, match="KV budget full"):
        s.forward([9] * 5)  # 13 rows: 4 blocks
    assert s.length == 8  # refused before the forward: nothing cached
    s.release()
    assert pool.used_blocks == 0 and s.length == 0


def _core_budget(model, blocks, block, engine="lean"):
    return f"{blocks * block * Runner(model, engine).kv_row_bytes}B"


@pytest.mark.parametrize("engine", ["lean", "hf"])
def test_verifier_running_session_past_the_budget_fails_alone(pairs, llama, engine):
    """A verify that would grow a session past the budget is refused alone
    (CapacityExceeded); the session is unchanged and goes on once room is
    made, the other session in the same batch is verified."""
    target, _ = pairs["llama"]
    v = Verifier(VerifierConfig(target, device="cpu", engine=engine, kv_block_size=8,
                                kv_cache_memory=_core_budget(llama, 4, 8, engine)), llama)
    v.open_session("a", list(range(40, 60)), GREEDY)  # 20 rows: 3 blocks
    v.open_session("b", [1, 2, 3], GREEDY)  # 1 block
    assert v.kv_pool.free_blocks == 0
    tokens = list(v.sessions["a"].tokens)
    jobs = [v.prepare("a", [5, 6, 7, 8]), v.prepare("b", [9])]
    results = v.verify_batch(jobs)
    assert isinstance(results[0], CapacityExceeded) and "session 'a'" in str(results[0])
    assert not isinstance(results[1], Exception)
    assert v.sessions["a"].tokens == tokens and v.sessions["a"].cache.length == len(tokens) - 1
    v.close_session("b")
    assert len(v.verify("a", [5, 6, 7, 8]).tokens) >= 1
    v.close_session("a")
    assert v.kv_pool.used_blocks == 0


def test_drafter_budget(pairs):
    """The drafter refuses a prompt past its budget and a Propose that would
    grow past it, the session unchanged; closing gives the blocks back."""
    _, drafter_dir = pairs["llama"]
    model = load_model(drafter_dir, "cpu")
    d = Drafter(DrafterConfig(drafter_dir, device="cpu", kv_block_size=8,
                              kv_cache_memory=_core_budget(model, 3, 8)), model)
    with pytest.raises(CapacityExceeded, match="drafter KV budget full"):
        d.open_session("big", list(range(40, 70)), GREEDY)
    assert d.kv_pool.used_blocks == 0 and d.num_sessions == 0
    d.open_session("a", list(range(40, 62)), GREEDY)  # 21 rows prefilled, 3 blocks (24 rows)
    with pytest.raises(CapacityExceeded, match="session 'a'"):
        d.propose(ProposeCall("a", [], [62], DraftShape.chain(4)))  # 23 rows cached, then 3 drafted
    d.close_session("a")
    assert d.kv_pool.used_blocks == 0
    d.open_session("a", list(range(40, 50)), GREEDY)
    assert len(d.propose(ProposeCall("a", [], [50], DraftShape.chain(4))).tree.tokens) == 4
    d.close_session("a")
    assert d.kv_pool.used_blocks == 0


def test_expired_sessions_give_their_blocks_back(pairs, llama):
    target, _ = pairs["llama"]
    v = Verifier(VerifierConfig(target, device="cpu", session_idle_timeout_s=1.0), llama)
    v.open_session("a", list(range(40, 60)), GREEDY)
    assert v.kv_pool.used_blocks == 1
    v.expire_idle(now=10**12)
    assert v.kv_pool.used_blocks == 0 and v.num_sessions == 0


def test_dtype_auto_takes_the_checkpoints():
    """The demo pair is saved as float16: auto loads it so; no dtype in the
    config means float32."""
    model = load_model(str(DEMO_DRAFTER), "cpu", "auto")
    assert model.dtype == torch.float16 and checkpoint_dtype(model.config) == "float16"
    assert load_model(str(DEMO_DRAFTER), "cpu").dtype == torch.float32  # the default on a CPU: float32

    class Bare:
        pass

    assert checkpoint_dtype(Bare()) == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(str(DEMO_DRAFTER), "cpu", "float8")


def test_the_default_dtype_is_float32_on_a_cpu_and_the_checkpoints_on_a_gpu():
    """`default` (every service's default) resolves on the replica's device:
    float32 on a CPU, the checkpoint's own (here float16) on a GPU, where a
    float32 8B model would not fit; resolution only reads the config, so the
    GPU case is checked without one. The services and `specd up` take it as
    their default."""
    from specd.deploy_config import DeploymentConfig
    from specd_core.runtime.models import resolve_dtype

    assert resolve_dtype(str(DEMO_DRAFTER), "default", "cpu") == "float32"
    assert resolve_dtype(str(DEMO_DRAFTER), "default", "cuda") == "float16"
    assert resolve_dtype(str(DEMO_DRAFTER), "default", "cuda:1") == "float16"
    assert resolve_dtype(str(DEMO_DRAFTER), "bfloat16", "cuda") == "bfloat16"  # an explicit choice stands
    assert resolve_dtype(str(DEMO_DRAFTER), "auto", "cpu") == "float16"
    assert VerifierConfig("m").dtype == DeploymentConfig("t", "d").dtype == "default"


def test_flags_check_the_budget_before_anything_starts(capsys, monkeypatch, tmp_path):
    from specd.cli import main
    from specd_core.net.service_main import _build_parser, _config_from_args

    parser = _build_parser("verifier_svc", VerifierConfig)
    args = parser.parse_args(["--model", "m", "--kv-cache-memory", "2GiB", "--kv-block-size", "32",
                              "--dtype", "auto", "--engine", "hf"])
    cfg = _config_from_args(VerifierConfig, args, None)
    assert (cfg.kv_cache_memory, cfg.kv_block_size, cfg.dtype, cfg.engine) == ("2GiB", 32, "auto", "hf")
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-memory", "lots"])
    assert "kv_cache_memory 'lots'" in capsys.readouterr().err
    monkeypatch.setenv("SPECD_HOME", str(tmp_path))  # no state of another `specd up`
    assert main(["up", "--kv-cache-memory", "1.5"]) == 2  # refused before Ray starts
    assert "a fraction must be in (0, 1]" in capsys.readouterr().err


def test_up_warns_about_replicas_on_the_fallback_engine():
    from specd.ray_deploy import fallback_warnings

    lines = fallback_warnings([
        ("verifier", "specd-verifier-0", {"engine": "lean", "model_type": "llama"}),
        ("drafter", "specd-drafter-0", {"engine": "hf", "model_type": "gpt2", "architecture": "GPT2LMHeadModel"}),
    ])
    assert lines == ["warning: drafter replica specd-drafter-0 runs the Hugging Face fallback engine (hf) for model "
                     "type gpt2 (GPT2LMHeadModel): slower than the lean engine; docs/models.md lists the models the "
                     "lean engine supports"]

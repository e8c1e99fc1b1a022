"""The service cores in-process (no grpc): cache bookkeeping across cycles, for
chains and trees (static and dynamic)."""
import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd_core.errors import CapacityExceeded, InvalidRequest
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.tree import TokenTree, path_to, paths_to_parents
from specd_core.runtime.models import Runner, load_model
from specd_core.runtime.propose_call import ProposeCall
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()


@pytest.fixture(scope="module", params=["lean", "hf"])
def cores(request, pairs):
    target, drafter = pairs["llama"]
    return (Verifier(VerifierConfig(target, device="cpu", engine=request.param)),
            Drafter(DrafterConfig(drafter, device="cpu", engine=request.param)))


@torch.inference_mode()
def next_logits(model, ids):
    return model(torch.tensor([ids])).logits[0, -1]


def check_tree_against_scratch(drafter_model, tokens, tree, shape):
    """Every node's children are what the drafter's model, run from scratch on the
    committed tokens + the node's path, ranks first (top-k, in order)."""
    t = TokenTree(tuple(tree.tokens), tuple(tree.parents))
    kids = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(tree.tokens[i])
    for node, got in kids.items():
        prefix = tokens + ([tree.tokens[n] for n in path_to(t, node)] if node >= 0 else [])
        ranked = torch.topk(next_logits(drafter_model, prefix), len(got)).indices.tolist()
        if shape.dynamic:   # pruning keeps a subset of the top_k candidates, in rank order
            ranked = torch.topk(next_logits(drafter_model, prefix), shape.top_k).indices.tolist()
            assert got == [x for x in ranked if x in got], (node, got, ranked)
        else:
            assert got == ranked, (node, got, ranked)


@pytest.mark.parametrize("shape", [DraftShape.chain(3), DraftShape(branching=(3, 2, 1)),
                                   DraftShape(paths=((0,), (1,), (0, 0), (1, 0), (1, 1), (0, 0, 0))),
                                   DraftShape(node_budget=10, max_depth=4, top_k=3)],
                         ids=["chain3", "static321", "paths", "dynamic10"])
def test_caches_track_committed_tokens_across_cycles(cores, shape):
    verifier, drafter = cores
    prompt = [40, 41, 42, 43]
    first = verifier.open_session("a", prompt, GREEDY)
    drafter.open_session("a", prompt, GREEDY)
    tokens, unsent, path = prompt + [first], [first], []
    kept = []
    try:
        for cycle in range(6):
            tree = drafter.propose(ProposeCall("a", path, unsent, shape)).tree
            assert len(tree.tokens) <= shape.max_nodes
            if shape.paths:   # exactly the listed nodes (the parents say which is which)
                assert tree.parents == paths_to_parents(list(shape.paths))
            # The drafter's cache, compacted and extended many times, still drafts
            # exactly what its model drafts from scratch on the committed tokens.
            check_tree_against_scratch(drafter.model, tokens, tree, shape)
            result = verifier.verify("a", tree.tokens, tree.parents)
            # Greedy: every emitted token is the target's argmax after its prefix.
            for j, tok in enumerate(result.tokens):
                assert tok == int(next_logits(verifier.model, tokens + result.tokens[:j]).argmax())
            tokens += result.tokens
            unsent, path = result.tokens, result.path
            kept.append(len(path))
            # Verifier invariant: the cache holds every committed token but the pending one.
            assert verifier.sessions["a"].cache.length == len(tokens) - 1
        assert sum(kept) > 0
    finally:
        verifier.close_session("a")
        drafter.close_session("a")
    assert verifier.num_sessions == 0 and verifier.kv_tokens == 0 and drafter.num_sessions == 0


def test_verifier_refuses_sessions_past_its_budget(pairs):
    target, _ = pairs["llama"]
    model = load_model(target, "cpu")
    block = 16
    budget = 4 * block * Runner(model).kv_row_bytes  # 4 blocks of 16 tokens
    v = Verifier(VerifierConfig(target, device="cpu", max_sessions=2, kv_cache_memory=f"{budget}B",
                                kv_block_size=block), model)
    assert v.kv_pool.total_blocks == 4
    v.open_session("a", [1, 2, 3], GREEDY)  # 1 block
    with pytest.raises(CapacityExceeded, match="KV budget full.*needs 4 more block"):
        v.open_session("b", [1] * 60, GREEDY)
    assert v.kv_pool.used_blocks == 1  # the refused session took nothing
    v.open_session("c", [1, 2], GREEDY)
    with pytest.raises(CapacityExceeded, match="limit of 2 sessions"):
        v.open_session("d", [1, 2], GREEDY)
    # Running sessions are unharmed.
    assert len(v.verify("a", [5, 6]).tokens) >= 1
    v.close_session("a")
    v.close_session("c")
    assert v.kv_pool.used_blocks == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compacted_cache_equals_fresh_prefill(cores, temperature):
    """After many cycles of tree verification (greedy and
    sampled, static and dynamic trees), the verifier's next-token logits equal
    a fresh prefill of the committed sequence."""
    verifier, drafter = cores
    params = SamplingParams(temperature=temperature, seed=3)
    prompt = [40, 41, 42, 43]
    first = verifier.open_session("c", prompt, params)
    drafter.open_session("c", prompt, params)
    unsent, path = [first], []
    shapes = [DraftShape(branching=(3, 2, 1)), DraftShape(node_budget=9, max_depth=4, top_k=3), DraftShape.chain(4)]
    try:
        for cycle in range(15):
            tree = drafter.propose(ProposeCall("c", path, unsent, shapes[cycle % 3])).tree
            result = verifier.verify("c", tree.tokens, tree.parents, tree.row_dists or None)
            unsent, path = result.tokens, result.path
        s = verifier.sessions["c"]
        got = s.cache.forward([s.tokens[-1]])[-1]
        want = verifier.model(torch.tensor([s.tokens])).logits[0, -1].float()
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    finally:
        verifier.close_session("c")
        drafter.close_session("c")


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafter_batch_equals_one_session_at_a_time(cores, temperature):
    """Propose for several sessions in one batch (catch-up forwards together,
    chains level by level, static and dynamic trees level by level) drafts
    what each session's own Propose drafts, over several cycles, q and all."""
    _, drafter = cores
    params = SamplingParams(temperature=temperature, seed=5)
    prompts = {"x": [40, 41, 42], "y": [50, 51, 52, 53, 54, 55], "z": [60, 61], "w": [70, 71, 72, 73]}
    shapes = {"x": DraftShape.chain(3), "y": DraftShape.chain(5), "z": DraftShape(branching=(2, 1)),
              "w": DraftShape(node_budget=7, max_depth=3, top_k=2)}
    assert_batch_equals_solo(drafter, params, prompts, shapes)


def test_trees_of_several_sessions_share_each_level_forward(cores, monkeypatch):
    """On the lean engine one forward per tree level serves every session's
    tree (static and dynamic shapes mixed), not one forward per session and
    level: the forwards that hold any tree's level are as many as the deepest
    tree's levels. (Hugging Face's engine runs them one after another.)"""
    _, drafter = cores
    if drafter.runner.engine != "lean":
        pytest.skip("Hugging Face's engine grows trees one after another")
    params = SamplingParams(temperature=0.9, seed=5)
    prompts = {"s": [40, 41, 42], "d": [50, 51, 52, 53], "t": [60, 61]}
    shapes = {"s": DraftShape(branching=(2, 2, 1)), "d": DraftShape(node_budget=8, max_depth=4, top_k=2),
              "t": DraftShape(branching=(3, 1))}
    for k, p in prompts.items():
        drafter.open_session(k, p, params)
    calls: list[set[int]] = []
    forward_batch = drafter.runner.forward_batch

    def counting(items, *args, **kwargs):
        calls.append({id(item[0]) for item in items})
        return forward_batch(items, *args, **kwargs)

    monkeypatch.setattr(drafter.runner, "forward_batch", counting)
    try:
        jobs = [drafter.prepare(ProposeCall(k, [], [p[-1] + 100], shapes[k])) for k, p in prompts.items()]
        trees = dict(zip(prompts, (p.tree for p in drafter.propose_batch(jobs))))
    finally:
        for k in prompts:
            drafter.close_session(k)
    caches = {k: id(drafter_cache) for k, drafter_cache in zip(prompts, (j.session.cache for j in jobs))}
    per_session = {k: sum(caches[k] in c for c in calls) for k in prompts}
    # Each tree's levels that went through the model (+1: the catch-up forward of its committed token).
    levels = {k: len({depth_of(t, n) for n in t.forwarded}) + 1 for k, t in trees.items()}
    assert per_session == levels, (per_session, levels)
    assert min(levels.values()) >= 2 and sorted(levels.values())[-2] >= 2  # two trees at least went deeper
    with_trees = sum(any(caches[k] in c for k in prompts) for c in calls)
    assert with_trees == max(levels.values()), (calls, levels)


def depth_of(tree, node: int) -> int:
    return 1 if tree.parents[node] < 0 else 1 + depth_of(tree, tree.parents[node])


def assert_batch_equals_solo(drafter, params, prompts: dict, shapes: dict, cycles: int = 4) -> list[dict]:
    """Sessions drafted one Propose each and the same sessions in one batch draft
    the same trees, cycle after cycle (each keeps its first node, then a token of
    our own choosing). Returns each cycle's batch trees by prompt key."""
    for tag in ("solo", "batch"):
        for k, p in prompts.items():
            drafter.open_session(f"{tag}-{k}", p, params)
    out = []
    try:
        outcome = {k: ([], [p[-1] + 100]) for k, p in prompts.items()}   # (accepted path, committed)
        for cycle in range(cycles):
            solo = {k: drafter.propose(ProposeCall(f"solo-{k}", *outcome[k], shapes[k])).tree for k in prompts}
            jobs = [drafter.prepare(ProposeCall(f"batch-{k}", *outcome[k], shapes[k])) for k in prompts]
            batch = dict(zip(prompts, (p.tree for p in drafter.propose_batch(jobs))))
            for k in prompts:
                a, b = solo[k], batch[k]
                assert (a.tokens, a.parents, a.forwarded, a.pruned) == (b.tokens, b.parents, b.forwarded, b.pruned), (
                    cycle, k)
                assert a.confidences == pytest.approx(b.confidences, abs=1e-5)
                assert len(a.row_dists) == len(b.row_dists)
                for (ia, pa), (ib, pb_) in zip(a.row_dists, b.row_dists):
                    assert ia == ib and torch.allclose(torch.tensor(pa), torch.tensor(pb_), atol=1e-5)
                outcome[k] = ([0], [a.tokens[0], 30 + cycle])
            out.append(batch)
    finally:
        for tag in ("solo", "batch"):
            for k in prompts:
                drafter.close_session(f"{tag}-{k}")
    return out


def test_resumed_session_continues_exactly(cores):
    """Failover: a session rebuilt from its committed tokens (verifier: resume,
    nothing sampled; drafter: open on all but the last, then a first proposal
    of the last) goes on exactly like the uninterrupted one."""
    verifier, drafter = cores
    prompt, shape = [40, 41, 42, 43], DraftShape.chain(3)
    unsent, path = [verifier.open_session("a", prompt, GREEDY)], []
    drafter.open_session("a", prompt, GREEDY)
    try:
        for _ in range(5):
            tree = drafter.propose(ProposeCall("a", path, unsent, shape)).tree
            result = verifier.verify("a", tree.tokens, tree.parents)
            unsent, path = result.tokens, result.path
        tokens = list(verifier.sessions["a"].tokens)
        with pytest.raises(InvalidRequest, match="at least one generated token"):
            verifier.open_session("b", tokens[:1], GREEDY, resume=True)
        assert verifier.open_session("b", tokens, GREEDY, resume=True) is None
        assert verifier.sessions["b"].tokens == tokens and verifier.sessions["b"].cache.length == len(tokens) - 1
        drafter.open_session("b", tokens[:-1], GREEDY)
        b_unsent, b_path = tokens[-1:], []
        for _ in range(5):
            tree = drafter.propose(ProposeCall("a", path, unsent, shape)).tree
            b_tree = drafter.propose(ProposeCall("b", b_path, b_unsent, shape)).tree
            assert (b_tree.tokens, b_tree.parents) == (tree.tokens, tree.parents)
            result = verifier.verify("a", tree.tokens, tree.parents)
            b_result = verifier.verify("b", tree.tokens, tree.parents)
            assert (b_result.path, b_result.tokens) == (result.path, result.tokens)
            unsent, path, b_unsent, b_path = result.tokens, result.path, b_result.tokens, b_result.path
        assert verifier.sessions["b"].tokens == verifier.sessions["a"].tokens
    finally:
        for core in (verifier, drafter):
            for sid in ("a", "b"):
                if sid in core.sessions:
                    core.close_session(sid)


def test_prefills_share_a_forward_and_admission_counts_the_batch(pairs):
    """OpenSession jobs batched with each other and with a verify (the servicer
    sends them through the batcher): each prefill's first token is what a lone
    prefill gives, the verify is unchanged, and the session limit counts the
    sessions admitted in the same batch."""
    import time

    target, _ = pairs["llama"]
    v = Verifier(VerifierConfig(target, device="cpu", max_sessions=3))
    alone = Verifier(VerifierConfig(target, device="cpu"))
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12], "c": [3, 4, 5, 6], "d": [7, 8]}
    v.open_session("a", prompts["a"], GREEDY)
    alone.open_session("a", prompts["a"], GREEDY)
    jobs = [v.prepare("a", [20, 21, 22])] + [v.prepare_open(sid, prompts[sid], GREEDY) for sid in "bcd"]
    got = v.verify_batch(jobs)
    assert got[0].tokens == alone.verify("a", [20, 21, 22]).tokens
    assert got[0].batch_sessions == 3                  # a's verify and two prefills
    for sid, first in zip("bc", got[1:3]):
        assert first == alone.open_session(sid, prompts[sid], GREEDY)
    assert isinstance(got[3], CapacityExceeded) and "limit of 3 sessions" in str(got[3])
    assert v.num_sessions == 3
    # The gather window's count: sessions with a call within 3 typical call
    # intervals, whose next call comes straight back (plain decoding: no
    # draft). All three call every ~20 ms; then a falls quiet and drops out.
    for _ in range(20):
        for sid in "abc":
            v.verify(sid, [])
        time.sleep(0.02)
    assert v.active_sessions() == 3
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 1.0:
        for sid in "bc":
            v.verify(sid, [])
        time.sleep(0.02)
    assert v.sessions.call_interval_s < 0.3, v.sessions.call_interval_s
    assert v.active_sessions() == 2
    # A session whose last verify carried a draft calls next after the
    # drafter: not waited for; back to plain decoding, it counts again.
    v.verify("b", [1])
    assert v.active_sessions() == 1
    v.verify("b", [])
    assert v.active_sessions() == 2
    # A batch's share of verifies: the open sessions that come straight back,
    # and half of the drafting ones, rounded up (the quiet one counts too).
    assert v.batch_share() == 3
    v.verify("b", [1])
    assert v.batch_share() == 3  # a and c, half of b
    v.verify("c", [1])
    assert v.batch_share() == 2  # a, half of b and c
    v.verify("a", [1])
    assert v.batch_share() == 2  # half of three

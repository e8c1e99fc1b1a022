"""Drafting that stops where the drafter is unsure (docs/rules.md, "Stopping where
the drafter is unsure"): DraftShape.min_confidence in the drafter's tree builders,
and the orchestrator learning where it pays (orchestrator/cycle/confidence.py).

- Lossless, statistically: the REAL tree builders (drafter_svc/tree_builder.py)
  draft from the toy first-order "LM" of tests/test_acceptance.py (a fake cache
  whose logits after a token are the drafter table's row for it) with a threshold
  that cuts most drafts, and the verifier's rules judge them: the law of the
  emitted sequences is the target's (same chi-square and 1e-6 thresholds as the
  chain and tree rule tests) for sampled chains, sampled static trees and dynamic
  trees. The tempting other rule - drop the unsure token instead of keeping it
  as the last one - is shown to fail the same test: whether a position is drafted
  would then depend on the token drawn there, and q would no longer be its law.
- The drafter core (tiny models, both engines): a chain is the unstopped chain
  cut after its first token under the threshold, cycle after cycle (so its cache
  follows the tokens it did propose); confidences are the drafter's own
  probabilities; static and dynamic trees grow nothing below an unsure node;
  batched sessions stop each on its own and draft what they draft alone; ahead
  branches stop the same way and, once taken, equal a fresh draft.
- The orchestrator: which nodes a verdict judged, acceptance per bucket learnt
  without the bias of counting unjudged nodes as rejected, the threshold rule,
  the learned threshold following the costs, the knobs' validation.

Run with `-s` to see the statistics.
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from drafter_svc.tree_builder import Chain, build_tree, grow_chains
from orchestrator.config import OrchestratorConfig
from orchestrator.cycle.adaptive import CostModel, SessionDepth
from orchestrator.cycle.confidence import (
    ConfidenceTable,
    confidence_threshold,
    monotone,
    tried_nodes,
)
from orchestrator.cycle.depth import AdaptiveDepth, DraftShaper, FixedDepth, learn_costs
from orchestrator.cycle.records import CycleRecord, Draft, Verdict
from orchestrator.edge.request import build_spec
from orchestrator.spec_config import (
    ConfigError,
    SpeculativeConfig,
    add_speculative_flags,
    speculative_config_from_args,
)
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.errors import InvalidRequest
from specd_core.net.wire import shape_from_proto, shape_to_proto
from specd_core.rules.acceptance import accept_tree_deterministic, accept_tree_sampled, dense_q
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams, logits_to_probs
from specd_core.rules.tree import TokenTree, path_to
from specd_core.runtime.models import load_model
from specd_core.runtime.propose_call import ProposeCall
from tests.test_acceptance import BOS, GoodnessOfFit, L, V, exact_sequence_law, goodness_of_fit, model_tables
from tests.test_cores import assert_batch_equals_solo

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()
PLAIN = SamplingParams(temperature=1.0)
NUCLEUS = SamplingParams(temperature=0.7, top_p=0.8)
N_TRIALS = 4_000        # sequences per correct case (about 1 ms each through the real builders)
N_TRIALS_WRONG = 3_000   # fewer only makes failing harder


# ---------------------------------------------------------------- the real builders on a toy LM

class MarkovCache:
    """A drafter cache for a first-order model: the logits after a token are
    its table row, whatever came before (the builders' positions and masks
    change nothing). Counts rows as a cache would."""

    def __init__(self, table: torch.Tensor):
        self.table, self.length = table, 1

    def forward(self, token_ids, last_only=False, positions=None, mask=None):
        self.length += len(token_ids)
        rows = self.table[token_ids]
        return rows[-1:] if last_only else rows


class MarkovRunner:
    def forward_batch(self, items, last_only=False):
        return [cache.forward(toks, last_only) for cache, toks, *_ in items]


def toy_draft(table: torch.Tensor, last: int, shape: DraftShape, params, gen):
    """A draft below `last` by the drafter's own code: chains through the
    batched chain builder, trees through build_tree."""
    cache = MarkovCache(table)
    if shape.is_chain:
        chain = Chain(cache, params, gen, shape.depth, table[last], shape.min_confidence)
        return grow_chains(MarkovRunner(), [chain], 32)[0]
    return build_tree(cache, table[last], shape, params, 32, gen)


def drop_unsure(tree):
    """The wrong rule: end the draft BEFORE its first unsure token."""
    cut = next((i for i, c in enumerate(tree.confidences) if c < MIN_CONF), len(tree.tokens))
    return tree.tokens[:cut], tree.parents[:cut], tree.row_dists[: cut + 1] if tree.row_dists else []


MIN_CONF = 0.3


def run_toy(shape: DraftShape, params, n_trials: int, seed: int, drop: bool = False):
    """Speculative decoding of n_trials sequences of L tokens; the fit against
    the target's exact law, and the fraction of drafts the threshold cut."""
    target, drafter, _ = model_tables()
    p_table = logits_to_probs(target, params)
    accept_gen, draft_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    counts = np.zeros(V**L)
    cut = cycles = 0
    for _ in range(n_trials):
        seq, last = [], BOS
        while len(seq) < L:
            t = toy_draft(drafter, last, shape, params, draft_gen)
            tokens, parents, dists = drop_unsure(t) if drop else (t.tokens, t.parents, t.row_dists)
            cut += t.pruned > 0
            cycles += 1
            tree = TokenTree(tuple(tokens), tuple(parents))
            p = p_table[[last, *tokens]]
            if dists:
                out = accept_tree_sampled(p, tree, dense_q([d[0] for d in dists], [d[1] for d in dists], V), accept_gen)
            else:
                out = accept_tree_deterministic(p, tree, accept_gen)
            seq += out.tokens
            last = seq[-1]
        counts[(seq[0] * V + seq[1]) * V + seq[2]] += 1
    return goodness_of_fit(counts.reshape((V,) * L), exact_sequence_law(p_table)), cut / cycles


def report(name: str, fit: GoodnessOfFit, cut: float) -> None:
    print(f"\n[{name}] {fit}  drafts cut {cut:.2f}", end="")


@pytest.mark.statistical
@pytest.mark.parametrize("name,shape,params", [
    ("chain T=1", DraftShape.chain(2), PLAIN),
    ("chain T=0.7 top-p 0.8", DraftShape.chain(2), NUCLEUS),
    ("static [2, 2] sampled children", DraftShape(branching=(2, 2)), PLAIN),
    ("dynamic (top-k children)", DraftShape(node_budget=5, max_depth=3, top_k=2), PLAIN),
])
def test_stopping_keeps_the_target_law(name, shape, params):
    fit, cut = run_toy(shape.with_confidence(MIN_CONF), params, N_TRIALS, seed=11)
    report(name, fit, cut)
    assert fit.ok, f"{name}: {fit}"
    assert cut > 0.2, f"{name}: the threshold cut only {cut:.2f} of the drafts; the test would prove little"


@pytest.mark.statistical
@pytest.mark.parametrize("params", [PLAIN, NUCLEUS], ids=["T=1", "T=0.7 top-p 0.8"])
def test_dropping_the_unsure_token_is_detected(params):
    fit, cut = run_toy(DraftShape.chain(2).with_confidence(MIN_CONF), params, N_TRIALS_WRONG, seed=12, drop=True)
    report("drop the unsure token", fit, cut)
    assert not fit.ok, f"the drop rule passed: {fit}"


# ---------------------------------------------------------------- the drafter core

@pytest.fixture(scope="module", params=["lean", "hf"])
def drafter(request, pairs):
    _, drafter_dir = pairs["llama"]
    return Drafter(DrafterConfig(drafter_dir, device="cpu", engine=request.param), load_model(drafter_dir, "cpu"))


@torch.inference_mode()
def probs_after(model, ids) -> torch.Tensor:
    return torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


def first_unsure(confidences: list[float], t: float) -> int:
    """The chain length the rule leaves: up to and including the first token under t."""
    return next((i + 1 for i, c in enumerate(confidences) if c < t), len(confidences))


def threshold_for(drafter: Drafter, prompt: list[int], quantile: float) -> float:
    """A threshold at this quantile of the confidences the drafter shows here
    (tiny random models are far less sure than real ones)."""
    drafter.open_session("probe", prompt, GREEDY)
    try:
        confs = drafter.propose(ProposeCall("probe", [], [prompt[-1]], DraftShape.chain(8))).tree.confidences
    finally:
        drafter.close_session("probe")
    return float(np.quantile(confs, quantile))


def test_chain_is_the_unstopped_chain_cut_after_its_first_unsure_token(drafter):
    """Two sessions fed the same verdicts, one stopping: cycle after cycle the
    stopped chain is the other's prefix up to and including its first token
    under the threshold. That it stays so after the drafter kept only the
    accepted rows of shorter drafts shows its cache follows what it proposed."""
    prompt, k = [40, 41, 42, 43], 4
    t = threshold_for(drafter, prompt + [7], 0.3)
    for sid in ("full", "stop"):
        drafter.open_session(sid, prompt, GREEDY)
    committed, path, stopped = [7], [], 0
    try:
        for cycle in range(8):
            full = drafter.propose(ProposeCall("full", path, committed, DraftShape.chain(k))).tree
            got = drafter.propose(ProposeCall("stop", path, committed, DraftShape.chain(k).with_confidence(t))).tree
            n = first_unsure(full.confidences, t)
            assert got.tokens == full.tokens[:n] and got.confidences == pytest.approx(full.confidences[:n]), cycle
            assert got.pruned == (n < k) and got.forwarded == list(range(n - 1)), cycle
            stopped += n < k
            # The confidence is the drafter's probability of its (greedy: its top) token.
            tokens = drafter.sessions["stop"].tokens
            p = probs_after(drafter.model, tokens)
            assert got.confidences[0] == pytest.approx(float(p.max()), abs=1e-5)
            assert got.tokens[0] == int(p.argmax())
            # Verdict: keep the first node when the cycle is even, then a token of our own.
            path = [0] if cycle % 2 == 0 else []
            committed = got.tokens[:1] + [30 + cycle] if path else [50 + cycle]
        assert 0 < stopped < 8, f"{stopped} of 8 chains stopped early: pick another threshold"
    finally:
        for sid in ("full", "stop"):
            drafter.close_session(sid)


def test_sampled_chain_confidences_are_q_of_the_drawn_tokens(drafter):
    params = SamplingParams(temperature=0.8, seed=9)
    prompt = [60, 61, 62]
    t = threshold_for(drafter, prompt + [5], 0.5) / 2
    drafter.open_session("s", prompt, params)
    committed, path, lengths = [5], [], set()
    try:
        for cycle in range(6):
            tree = drafter.propose(ProposeCall("s", path, committed, DraftShape.chain(4).with_confidence(t))).tree
            for i, (tok, conf) in enumerate(zip(tree.tokens, tree.confidences)):
                ids, probs = tree.row_dists[i]
                assert conf == pytest.approx(probs[ids.index(tok)])   # its q, the law it was drawn from
            n = first_unsure(tree.confidences, t)
            assert len(tree.tokens) == n and tree.pruned == (n < 4)
            lengths.add(n)
            path, committed = [0], [tree.tokens[0], 20 + cycle]
    finally:
        drafter.close_session("s")
    assert len(lengths) > 1, lengths


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_sessions_stop_each_on_their_own(drafter, temperature):
    """One propose_batch over sessions with different thresholds (chains level
    by level together on the lean engine, and a tree) drafts what each one's
    own Propose drafts, the stops included."""
    params = SamplingParams(temperature=temperature, seed=5)
    prompts = {"x": [40, 41, 42], "y": [50, 51, 52, 53, 54, 55], "z": [60, 61], "w": [70, 71, 72]}
    t = threshold_for(drafter, prompts["x"], 0.5)
    shapes = {"x": DraftShape.chain(5).with_confidence(t), "y": DraftShape.chain(5),
              "z": DraftShape(branching=(2, 1)).with_confidence(t), "w": DraftShape.chain(5).with_confidence(0.999)}
    cycles = assert_batch_equals_solo(drafter, params, prompts, shapes)
    for batch in cycles:
        assert len(batch["w"].tokens) == 1 and len(batch["y"].tokens) == 5   # stopped at once / never
        assert batch["x"].pruned == (len(batch["x"].tokens) < 5)
    assert {len(b["x"].tokens) for b in cycles} != {5}, "x never stopped early"


def test_static_tree_grows_nothing_below_an_unsure_node(drafter):
    prompt, shape = [40, 41, 42, 43], DraftShape(branching=(3, 2, 1))
    t = threshold_for(drafter, prompt + [9], 0.4)
    for sid in ("full", "stop"):
        drafter.open_session(sid, prompt, GREEDY)
    try:
        full = drafter.propose(ProposeCall("full", [], [9], shape)).tree
        got = drafter.propose(ProposeCall("stop", [], [9], shape.with_confidence(t))).tree
        full_tree = TokenTree(tuple(full.tokens), tuple(full.parents))
        # The nodes every strict ancestor of which is sure enough, in the same order.
        keep = [i for i in range(len(full.tokens)) if all(full.confidences[a] >= t for a in path_to(full_tree, i)[:-1])]
        assert got.tokens == [full.tokens[i] for i in keep]
        assert got.confidences == pytest.approx([full.confidences[i] for i in keep])
        inner = {p for p in full.parents if p >= 0}
        assert got.pruned == sum(full.confidences[i] < t for i in keep if i in inner) > 0
        assert len(got.tokens) < len(full.tokens)
        # Siblings stay: each kept node's children are as many as the shape gives.
        for i in keep:
            n_children = sum(full.parents[j] == i for j in keep)
            assert n_children == (0 if full.confidences[i] < t else sum(p == i for p in full.parents))
    finally:
        for sid in ("full", "stop"):
            drafter.close_session(sid)


def test_dynamic_tree_expands_only_sure_nodes(drafter):
    prompt = [40, 41, 42, 43]
    shape = DraftShape(node_budget=12, max_depth=4, top_k=3)
    drafter.open_session("probe", prompt, GREEDY)
    try:
        full = drafter.propose(ProposeCall("probe", [], [9], shape)).tree
    finally:
        drafter.close_session("probe")
    # Between the root's two best children: the best is expanded, the others not.
    first, second = sorted((c for c, p in zip(full.confidences, full.parents) if p < 0), reverse=True)[:2]
    t = (first + second) / 2
    drafter.open_session("dyn", prompt, GREEDY)
    try:
        tree = drafter.propose(ProposeCall("dyn", [], [9], shape.with_confidence(t))).tree
        parents = {p for p in tree.parents if p >= 0}
        assert parents and all(tree.confidences[p] >= t for p in parents)
        assert tree.pruned > 0
        # Confidences are the drafter's probabilities of the nodes' tokens.
        tokens = list(drafter.sessions["dyn"].tokens)
        p = probs_after(drafter.model, tokens)
        for i, parent in enumerate(tree.parents):
            if parent < 0:
                assert tree.confidences[i] == pytest.approx(float(p[tree.tokens[i]]), abs=1e-5)
        # The next cycle still drafts what a fresh session drafts (its rows were kept right).
        path = [0] + [i for i, q in enumerate(tree.parents) if q == 0][:1]
        committed = [tree.tokens[i] for i in path] + [3]
        again = drafter.propose(ProposeCall("dyn", path, committed, shape.with_confidence(t))).tree
        drafter.open_session("fresh", tokens + committed[:-1], GREEDY)
        fresh = drafter.propose(ProposeCall("fresh", [], committed[-1:], shape.with_confidence(t))).tree
        assert (again.tokens, again.parents) == (fresh.tokens, fresh.parents)
    finally:
        drafter.close_session("dyn")
        if "fresh" in drafter.sessions:
            drafter.close_session("fresh")


def test_ahead_branches_stop_too_and_taking_one_equals_a_fresh_draft(pairs):
    _, drafter_dir = pairs["llama"]
    model = load_model(drafter_dir, "cpu")
    plain, piped = (Drafter(DrafterConfig(drafter_dir, device="cpu", engine="lean"), model) for _ in range(2))
    prompt, k = [8, 3, 19, 4, 25, 6], 3
    t = threshold_for(plain, prompt, 0.4)
    shape = DraftShape.chain(k).with_confidence(t)
    for d in (plain, piped):
        d.open_session("a", prompt, GREEDY)
    first = piped.propose(ProposeCall("a", [], [prompt[-1]], DraftShape.chain(k))).tree
    plain.propose(ProposeCall("a", [], [prompt[-1]], DraftShape.chain(k)))
    chain = first.tokens
    ahead = piped.propose(ProposeCall("a", [0, 1, 2], chain, shape, ahead=True, alternatives=2))
    branches = [ahead.tree] + [b.tree for b in ahead.branches]
    for b in branches:
        n = first_unsure(b.confidences, t)
        assert len(b.tokens) == n and b.pruned == (n < k) and len(b.confidences) == n
    assert len({len(b.tokens) for b in branches}) > 1, "no branch stopped early, or all did"
    index, branch = next((i + 1, b) for i, b in enumerate(ahead.branches) if b.kept == 1)
    want = plain.propose(ProposeCall("a", [0], [chain[0], branch.token], shape)).tree
    assert branch.tree.tokens == want.tokens
    nxt = ([0], [branch.tree.tokens[0], 5])
    assert piped.propose(ProposeCall("a", *nxt, shape, branch=index)).tree.tokens == plain.propose(ProposeCall("a", *nxt, shape)).tree.tokens
    a, b = piped.sessions["a"], plain.sessions["a"]
    assert (a.tokens, a.cache.length, a.last.tokens) == (b.tokens, b.cache.length, b.last.tokens)


def test_drafter_refuses_a_bad_threshold(drafter):
    drafter.open_session("bad", [1, 2, 3], GREEDY)
    try:
        for t in (-0.1, 1.0, math.nan):
            with pytest.raises(InvalidRequest, match="min_confidence must be in"):
                drafter.propose(ProposeCall("bad", [], [4], DraftShape.chain(2).with_confidence(t)))
    finally:
        drafter.close_session("bad")


# ---------------------------------------------------------------- learning and the threshold

def test_tried_nodes_are_those_the_rules_judged():
    # A chain kept for two nodes: node 2 judged and rejected, node 3 never judged.
    assert tried_nodes([-1, 0, 1, 2], [0, 1]) == [(0, True), (1, True), (2, False)]
    assert tried_nodes([-1, 0, 1], []) == [(0, False)]
    # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}. Path [1, 4]: 0 tried first and rejected,
    # 1 kept, 4 kept; 0's children never judged (0 was rejected).
    assert tried_nodes([-1, -1, 0, 0, 1], [1, 4]) == [(0, False), (1, True), (4, True)]
    # Path [0, 3]: 1 never tried (its elder sibling 0 was kept); 2 rejected before 3 kept.
    assert tried_nodes([-1, -1, 0, 0, 1], [0, 3]) == [(0, True), (2, False), (3, True)]


def test_acceptance_per_bucket_is_learnt_without_the_censoring_bias():
    """Chains whose node i is kept, given its parent kept, with probability
    equal to its confidence: every bucket learns its own rate. Counting the
    nodes after a rejection as rejected (never judged) would put the
    confident buckets far below it."""
    rng = np.random.default_rng(0)
    table, naive = ConfidenceTable(decay=1.0), ConfidenceTable(decay=1.0)
    for _ in range(8000):
        conf = rng.uniform(0.0, 1.0, size=6).tolist()
        kept = 0
        while kept < 6 and rng.random() < conf[kept]:
            kept += 1
        table.observe(list(range(-1, 5)), conf, list(range(kept)))
        for i, c in enumerate(conf):   # the biased way: a node past the first rejection counts as rejected
            naive.observe([-1], [c], [0] if i < kept else [])
    for b, rate in enumerate(table.rates):
        assert rate == pytest.approx(b / 10 + 0.05, abs=0.06), (b, table.rates)
    # After a kept node the next one is kept with probability its own confidence,
    # uniform: 0.5 on average, whatever the node's own bucket.
    assert table.onward == pytest.approx([0.5] * 10, abs=0.08)
    assert naive.rates[9] < 0.6 < table.rates[9] - 0.3   # the bias a wrong count would have
    assert all(table.known)


def test_monotone_fit_pools_violators():
    assert monotone([0.2, 0.5, 0.4, 0.9], [1, 1, 1, 1]) == pytest.approx([0.2, 0.45, 0.45, 0.9])
    assert monotone([0.9, 0.1], [1, 3]) == pytest.approx([0.3, 0.3])
    assert monotone([], []) == []


def test_threshold_rule():
    rates = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
    onward, known, w = [0.8] * 10, [True] * 10, [50.0] * 10
    # Below a node of bucket b pays iff rates[b] * 0.8 * 2 ms >= 0.8 ms: rates[b] >= 0.5 -> t = 0.4.
    assert confidence_threshold(rates, onward, known, w, token_ms=2.0, extra_ms=0.8) == pytest.approx(0.4)
    # Dearer drafting raises it, a dearer token (more to gain) lowers it.
    assert confidence_threshold(rates, onward, known, w, 2.0, 1.2) == pytest.approx(0.7)    # rates < 0.75 fail
    assert confidence_threshold(rates, onward, known, w, 20.0, 0.8) == 0.0
    # What follows a kept node counts: a bucket whose kept nodes are followed
    # by kept ones pays where the same acceptance alone would not.
    assert confidence_threshold(rates, [0.8] * 3 + [1.0] * 7, known, w, 2.0, 0.8) == pytest.approx(0.3)
    # Everything fails: capped at the top bucket's lower edge (k = 0 is the depth rule's call).
    assert confidence_threshold(rates, onward, known, w, 2.0, 100.0) == pytest.approx(0.9)
    # A bucket without data of its own never cuts; nor does a table with none (cold start).
    few = [b >= 6 for b in range(10)]
    assert confidence_threshold(rates, onward, few, w, 2.0, 0.8) == 0.0
    assert confidence_threshold(rates, onward, few, w, 2.0, 1.2) == pytest.approx(0.7)
    assert confidence_threshold(rates, onward, [False] * 10, w, 2.0, 100.0) == 0.0
    # A noisy dip above good buckets is pooled with its neighbours, not cut above them.
    dip = [0.2, 0.3, 0.6, 0.7, 0.3, 0.8, 0.8, 0.9, 0.9, 0.9]
    dip_w = [5, 5, 50, 50, 2, 50, 50, 50, 50, 50]
    assert confidence_threshold(dip, onward, known, dip_w, 2.0, 0.8) == pytest.approx(0.2)


def test_fresh_table_stops_nothing():
    table = ConfidenceTable(decay=1.0)
    assert table.threshold(token_ms=1.0, extra_ms=100.0) == 0.0
    for _ in range(int(table.min_weight) - 1):   # one short of min_weight
        table.observe([-1], [0.05], [])
    assert table.threshold(1.0, 100.0) == 0.0
    table.observe([-1], [0.05], [])
    assert table.threshold(1.0, 100.0) == pytest.approx(0.1)
    table.observe([-1, 0], [0.5], [0])   # a draft without a confidence per node teaches nothing
    assert table.weights[5] == 0.0


def trained_costs(row_ms: float, draft_ms: float = 0.5) -> CostModel:
    """A ready cost model: verify a + row_ms per row, drafting draft_ms a level,
    and a drafter whose low-confidence tokens are kept half as often."""
    costs = CostModel()
    for i in range(60):
        rows = 1 + i % 6
        costs.observe_verify(rows, 1, 5.0 + row_ms * rows)
        costs.observe_draft(4, 4 * draft_ms)
        costs.observe_cycle(6.0 + row_ms * 5 + 4 * draft_ms, 5.0 + row_ms * 5, 4 * draft_ms)
        costs.observe_tokens(3)
        costs.observe_levels(4, 2)
    for b in range(10):
        for j in range(40):
            costs.confidence.observe([-1], [b / 10 + 0.05], [0] if j < 40 * (0.3 + 0.07 * b) else [])
    return costs


def test_learned_threshold_follows_the_costs():
    s = SessionDepth(k_max=4)
    assert s.threshold(CostModel(), 4, 0, 0) == 0.0   # not ready: off
    cheap, dear = trained_costs(row_ms=0.05), trained_costs(row_ms=2.0)
    t_cheap, t_dear = s.threshold(cheap, 4, 0, 0), s.threshold(dear, 4, 0, 0)
    assert t_cheap < t_dear, (t_cheap, t_dear)
    # Under load (a forward full of other sessions' rows) a row costs more than at batch 1.
    assert s.threshold(dear, 4, 60, 15) >= t_dear
    assert s.threshold(dear, 0, 0, 0) == 0.0


def test_shaper_sets_the_threshold_and_learn_costs_fills_the_table():
    costs = trained_costs(row_ms=2.0)
    adaptive = AdaptiveDepth(SessionDepth(4), costs)
    learned = DraftShaper(DraftShape.chain(4), adaptive, 512, 512, confidence=None).next(10, 100)
    assert learned.min_confidence == adaptive.threshold(adaptive.choose()) > 0
    fixed = DraftShaper(DraftShape(branching=(2, 1)), FixedDepth(2, costs), 512, 512, confidence=0.25)
    assert fixed.next(10, 100) == DraftShape(branching=(2, 1), min_confidence=0.25)
    # Near the end of the output the cut shape keeps the threshold.
    assert fixed.next(10, 2) == DraftShape(branching=(2,), min_confidence=0.25)
    off = DraftShaper(DraftShape.chain(3), FixedDepth(3, costs), 512, 512)
    assert off.next(10, 100).min_confidence == 0.0
    before = costs.confidence.weights[9]
    draft = Draft([5, 6, 7], [-1, 0, 1], confidences=[0.95, 0.92, 0.5])
    learn_costs(costs, CycleRecord(0, draft, Verdict([0, 1], [5, 6, 8]), 5.0))
    assert costs.confidence.weights[9] == pytest.approx(0.99**2 * before + 0.99 + 1)   # nodes 0 and 1
    assert costs.confidence.weights[5] > 0


# ---------------------------------------------------------------- knobs

def spec(fields: dict, speculative: SpeculativeConfig | None = None):
    req = pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=[1, 2, 3]), **fields)
    config = OrchestratorConfig("target", speculative=speculative or SpeculativeConfig())
    return build_spec(req, config, None, 384, 256, has_drafter=True)


def test_request_threshold_and_its_defaults():
    assert spec({}).confidence is None                               # adaptive + "auto": learned
    assert spec({"num_speculative_tokens": 3}).confidence == 0.0     # its own K: drafted as asked
    assert spec({"adaptive_speculation": False}).confidence == 0.0
    assert spec({"confidence_threshold": 0.25}).confidence == pytest.approx(0.25)
    assert spec({"confidence_threshold": 0.0}).confidence == 0.0
    fixed = SpeculativeConfig(confidence_threshold=0.4)
    assert spec({"num_speculative_tokens": 3}, fixed).confidence == pytest.approx(0.4)
    assert spec({"confidence_threshold": 0.1}, fixed).confidence == pytest.approx(0.1)
    assert spec({}, SpeculativeConfig(confidence_threshold=0)).confidence == 0.0
    assert spec({"speculative_method": "ngram"}).confidence == 0.0
    assert spec({"speculative_method": "ngram"}, fixed).confidence == 0.0


@pytest.mark.parametrize("fields,needle", [
    ({"confidence_threshold": -0.1}, "confidence_threshold must be in [0, 1)"),
    ({"confidence_threshold": 1.0}, "confidence_threshold must be in [0, 1)"),
    ({"confidence_threshold": math.nan}, "confidence_threshold must be in [0, 1)"),
    ({"confidence_threshold": 0.3, "speculative_method": "ngram"}, "confidence_threshold needs speculative_method"),
    ({"confidence_threshold": 0.3, "num_speculative_tokens": 0}, "confidence_threshold needs speculative_method"),
    ({"tree": pb.DraftShape(branching=[2], min_confidence=0.3)}, "tree.min_confidence"),
])
def test_bad_request_thresholds(fields, needle):
    with pytest.raises(InvalidRequest) as e:
        spec(fields)
    assert needle in str(e.value)


def test_config_threshold():
    assert SpeculativeConfig().validate().confidence_threshold == "auto"
    assert SpeculativeConfig.from_dict({"confidence_threshold": 0.3}).confidence_threshold == 0.3
    assert SpeculativeConfig.from_dict({"confidence_threshold": 0}).confidence_threshold == 0
    for bad in ("high", 1.0, -0.5, True, None):
        with pytest.raises(ConfigError, match="speculative_config.confidence_threshold"):
            SpeculativeConfig.from_dict({"confidence_threshold": bad})
    parser = argparse.ArgumentParser()
    add_speculative_flags(parser)

    def from_flags(*argv):
        return speculative_config_from_args(parser.parse_args(argv)).confidence_threshold

    assert from_flags() == "auto" and from_flags("--confidence-threshold", "auto") == "auto"
    assert from_flags("--confidence-threshold", "0.3") == 0.3
    with pytest.raises(ConfigError, match="confidence_threshold"):
        from_flags("--confidence-threshold", "1.5")


def test_shape_carries_the_threshold():
    shape = DraftShape(paths=((0,), (1,), (0, 0), (0, 0, 0)), min_confidence=0.2)
    assert shape.truncated(2).min_confidence == 0.2 and shape.fit(3, 3).min_confidence == 0.2
    dyn = DraftShape(node_budget=10, max_depth=8, top_k=4, min_confidence=0.2)
    assert dyn.fit_rows(5).min_confidence == 0.2 and dyn.fit(4, 99).min_confidence == 0.2
    back = shape_from_proto(shape_to_proto(shape))
    assert back.paths == shape.paths and back.min_confidence == pytest.approx(0.2)
    assert DraftShape.chain(3).with_confidence(0.0) == DraftShape.chain(3)

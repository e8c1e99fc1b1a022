"""The acceptance rules are lossless: the statistical core of "sampling is exact"
(docs/rules.md, "The rules that keep output exact"), on the chain forms of the rules
(tests/chain_rules.py).

Setting. A toy "language model" over a small vocabulary V=6: the target is a table
of logits T[prev] -> next (row BOS for the first token), and the drafter is a
different table D[prev] that deliberately disagrees with it (anti-correlated rows
favour exactly the tokens the target dislikes; the other rows are noisy copies,
so drafts are sometimes accepted and sometimes not). Both go through the request's
`logits_to_probs`, as the real verifier and drafter do.

The test pipeline runs the real speculative loop: each cycle drafts K=2 tokens
autoregressively from the drafter table starting at the last emitted token,
builds the verifier's p rows (K+1, V) = [p(.|last), p(.|d1), p(.|d2)] (so the p
row of a position depends on the drafted prefix, and positions after a rejection,
the bonus token and the next cycle are all exercised), calls the acceptance rule
and appends the emitted tokens; sequences are truncated to L=3 tokens. The
empirical law of the 6^3 = 216 possible sequences is compared with the exact
target law prod_t p(x_t | x_{t-1}) by a chi-square goodness-of-fit statistic
(cells with expected count < 5 pooled; a sequence of target probability zero
that is emitted even once makes the statistic infinite).

Threshold: the chi-square quantile at false-alarm probability 1e-6 for the
test's degrees of freedom (Wilson-Hilferty approximation): the correct rules
pass with a wide margin at the fixed seeds, and at any other seed a correct rule
would fail a given check with probability about 1e-6. The
SAME machinery (same pipeline, same statistic, same threshold) is then run on
deliberately wrong rules written below, and each must land above the threshold:
that is what shows the test can see a wrong rule. Most wrong rules run on fewer
trials than the correct ones; that only makes failing harder (chi-square's excess
over its null mean grows linearly with the number of trials), so it is
conservative. The bonus-row bug, the subtlest, gets the full count.

Run with `-s` to see the statistics.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from specd_core.rules.acceptance import dense_q, residual
from specd_core.rules.chain_batch import ChainDraw, decide_chains, uniforms
from specd_core.rules.sampling import SamplingParams, logits_to_probs, sample, truncate_top
from tests.chain_rules import accept_deterministic, accept_greedy, accept_on_device, accept_sampled

pytestmark = pytest.mark.unit

V = 6          # vocabulary
BOS = V        # context row for the first token
K = 2          # drafts per cycle: K=2 with L=3 reaches the bonus token and a second cycle
L = 3          # sequence length compared
N_TRIALS = 20_000        # sequences per correct rule
N_TRIALS_WRONG = 4_000   # sequences per wrong rule (conservative, see module docstring)
Z_1E6 = 4.753            # one-sided standard normal quantile for p = 1e-6
MIN_EXPECTED = 5.0

PLAIN = SamplingParams(temperature=1.0, top_p=1.0, seed=0)
NUCLEUS = SamplingParams(temperature=0.7, top_p=0.8, seed=0)
TOPK_NUCLEUS = SamplingParams(temperature=1.3, top_k=4, top_p=0.9, seed=0)


# ---------------------------------------------------------------- statistics

def chi2_threshold(df: int, z: float = Z_1E6) -> float:
    """Upper chi-square quantile (Wilson-Hilferty): P(chi2_df > t) ~= Phi(-z)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@dataclass
class GoodnessOfFit:
    chi2: float
    df: int
    threshold: float
    tv: float            # total-variation distance, for information
    impossible: int      # emissions of zero-probability cells

    @property
    def ok(self) -> bool:
        return self.chi2 <= self.threshold

    def __str__(self) -> str:
        return (f"chi2={self.chi2:9.1f} (df={self.df}, threshold={self.threshold:6.1f}, "
                f"ratio={self.chi2 / self.threshold:7.2f})  TV={self.tv:.4f}  impossible={self.impossible}")


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> GoodnessOfFit:
    """Pearson chi-square of observed `counts` against exact `probs` (same shape).

    Cells with probability 0 must be empty (else chi2 = inf). Cells with expected
    count < MIN_EXPECTED are pooled into one bin so the chi-square approximation
    (and hence the threshold) is valid.
    """
    counts = counts.ravel().astype(np.float64)
    probs = probs.ravel().astype(np.float64)
    probs = probs / probs.sum()
    n = counts.sum()
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    zero = probs == 0
    impossible = int(counts[zero].sum())
    exp = probs * n
    big = (~zero) & (exp >= MIN_EXPECTED)
    obs_bins = list(counts[big])
    exp_bins = list(exp[big])
    small = (~zero) & ~big
    if small.any():
        obs_bins.append(counts[small].sum())
        exp_bins.append(exp[small].sum())
    obs_bins, exp_bins = np.array(obs_bins), np.array(exp_bins)
    df = len(exp_bins) - 1
    chi2 = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
    if impossible:
        chi2 = math.inf
    return GoodnessOfFit(chi2, df, chi2_threshold(df), tv, impossible)


# ---------------------------------------------------------------- toy models

def model_tables(seed: int = 2, argmax_noise: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target, drafter, argmax drafter) logits, each (V+1, V): row c = logits of
    the next token after token c (row BOS: first token).

    drafter: even rows are the negated target (q favours what p dislikes, and
    under top-p mostly what p has removed), odd rows a noisy copy of the target.
    argmax drafter: a noisy copy whose argmax is often, not always, the target's
    favourite (so that all-kept cycles are common enough to test the bonus)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V + 1, V, generator=g) * 0.8
    noise = torch.randn(V + 1, V, generator=g)
    anti = torch.arange(V + 1).remainder(2).eq(0).unsqueeze(1)
    drafter = torch.where(anti, -target + 0.5 * noise, target + 1.0 * noise)
    argmax_drafter = target + argmax_noise * torch.randn(V + 1, V, generator=g)
    return target, drafter, argmax_drafter


def exact_sequence_law(p_table: torch.Tensor) -> np.ndarray:
    """(V,)*L array: probability of each L-token sequence under the target."""
    P = p_table.double().numpy()
    law = P[BOS]
    for _ in range(L - 1):
        law = law[..., None] * P[:V]   # (..., last, next) = law(..., last) * p(next | last)
    return law


class TableSampler:
    """Fast exact inverse-CDF sampling from the rows of a (rows, V) probability
    table, with seeded numpy uniforms (used for drafting only; acceptance
    randomness comes from the torch generator handed to the rule). A token of
    probability 0 is never drawn (its CDF step is empty)."""

    BLOCK = 1 << 16

    def __init__(self, table: torch.Tensor, seed: int):
        cum = np.cumsum(table.double().numpy(), axis=1)
        self.cum = (cum / cum[:, -1:]).tolist()
        self.rng = np.random.default_rng(seed)
        self.u: list[float] = []

    def __call__(self, row: int) -> int:
        if not self.u:
            self.u = self.rng.random(self.BLOCK).tolist()
        return bisect.bisect_right(self.cum[row], self.u.pop())


class RowCache(dict):
    """rows[(a, b, ...)] == table[[a, b, ...]], built once per key (the pipeline
    spends its time in the rule under test, not in tensor indexing)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def __missing__(self, key: tuple[int, ...]) -> torch.Tensor:
        rows = self[key] = self.table[list(key)]
        return rows


# A drafter returns (draft ids, what it sends as q: a (K, V) tensor or None).
Drafter = Callable[[int], tuple[list[int], "torch.Tensor | None"]]
# An acceptance rule as the pipeline calls it.
Rule = Callable[[torch.Tensor, list[int], "torch.Tensor | None", torch.Generator], object]


def sampled_drafter(q_table: torch.Tensor, seed: int) -> Drafter:
    """Draws d1 ~ q(.|last), d2 ~ q(.|d1) and sends the rows it drew from."""
    draw = TableSampler(q_table, seed)
    sent = RowCache(q_table)

    def drafter(last: int):
        ids, prev = [], last
        for _ in range(K):
            prev = draw(prev)
            ids.append(prev)
        return ids, sent[(last, *ids[:-1])]   # q rows [q(.|last), q(.|d1), ...]
    return drafter


def truncated_drafter(q_table: torch.Tensor, top_n: int, seed: int, send: str = "sparse") -> Drafter:
    """Samples each draft from truncate_top(q(.|prev), top_n), as the real drafter
    does, and sends that truncated q sparsely (ids + probs lists) for the verifier
    to densify with dense_q. send="full" is the bug of sending the untruncated q."""
    wire = [tuple(x.tolist() for x in truncate_top(q_table[r], top_n)) for r in range(q_table.shape[0])]
    truncated = torch.zeros_like(q_table)
    for r, (ids, probs) in enumerate(wire):
        truncated[r, ids] = torch.tensor(probs)
    draw = TableSampler(truncated, seed)
    full = RowCache(q_table)
    densified: dict[tuple[int, ...], torch.Tensor] = {}

    def drafter(last: int):
        ids, prev = [], last
        for _ in range(K):
            prev = draw(prev)
            ids.append(prev)
        rows = (last, *ids[:-1])
        if send == "full":
            return ids, full[rows]
        if rows not in densified:  # what the verifier rebuilds from the sparse wire format
            densified[rows] = dense_q([wire[r][0] for r in rows], [wire[r][1] for r in rows], V)
        return ids, densified[rows]
    return drafter


def argmax_drafter(q_table: torch.Tensor) -> Drafter:
    """Deterministic drafter: d1 = argmax q(.|last), d2 = argmax q(.|d1). Sends no q."""
    best = q_table.argmax(-1).tolist()

    def drafter(last: int):
        ids, prev = [], last
        for _ in range(K):
            prev = best[prev]
            ids.append(prev)
        return ids, None
    return drafter


@dataclass
class PipelineResult:
    counts: np.ndarray          # (V,)*L histogram of emitted L-token sequences
    accepted_hist: np.ndarray   # (K+1,) cycles by number of drafts kept


def run_pipeline(p_table: torch.Tensor, drafter: Drafter, rule: Rule, n_trials: int, seed: int) -> PipelineResult:
    """Speculative decoding of `n_trials` sequences of L tokens.

    p_table: (V+1, V) the verifier's p(next | prev) (logits_to_probs of the target
    logits, unless a test deliberately gets it wrong).
    """
    g = torch.Generator().manual_seed(seed)
    p_rows = RowCache(p_table)
    counts = [0] * V**L
    accepted_hist = [0] * (K + 1)
    for _ in range(n_trials):
        seq: list[int] = []
        last = BOS
        while len(seq) < L:
            draft_ids, q = drafter(last)
            p = p_rows[(last, *draft_ids)]             # (K+1, V) rows for [pending, d1..dK]
            out = rule(p, draft_ids, q, g)
            n = out.num_accepted
            accepted_hist[n] += 1
            assert len(out.tokens) == n + 1 and out.tokens[:n] == draft_ids[:n]
            seq += out.tokens
            last = seq[-1]
        counts[(seq[0] * V + seq[1]) * V + seq[2]] += 1
    return PipelineResult(np.array(counts).reshape((V,) * L), np.array(accepted_hist))


def rule_sampled(p, draft_ids, q, g):
    return accept_sampled(p, draft_ids, q, g)


def rule_deterministic(p, draft_ids, q, g):
    assert q is None
    return accept_deterministic(p, draft_ids, g)


def run_pipeline_on_device(p_table: torch.Tensor, drafter: Drafter, n_trials: int, seed: int,
                           batch: int = 2_000) -> PipelineResult:
    """run_pipeline with the verifier's batched chain rule (specd_core.rules.chain_batch):
    `batch` sequences in lock-step, each cycle ONE decide_chains call over all of
    them, their p rows stacked as the verifier stacks its sessions' (so a row
    read at the wrong offset would show in the law)."""
    g = torch.Generator().manual_seed(seed)
    p_rows = RowCache(p_table)
    counts = [0] * V**L
    accepted_hist = [0] * (K + 1)
    for start in range(0, n_trials, batch):
        seqs: list[list[int]] = [[] for _ in range(min(batch, n_trials - start))]
        while live := [seq for seq in seqs if len(seq) < L]:
            draws, rows = [], []
            for i, seq in enumerate(live):
                last = seq[-1] if seq else BOS
                draft_ids, q = drafter(last)
                laws = None if q is None else [
                    ([x for x, v in enumerate(row) if v > 0], [v for v in row if v > 0]) for row in q.tolist()
                ]
                draws.append(ChainDraw(i * (K + 1), draft_ids, laws, uniforms(K, g)))
                rows.append(p_rows[(last, *draft_ids)])
            for seq, d, (n, token) in zip(live, draws, decide_chains(torch.cat(rows), draws).tolist()):
                accepted_hist[n] += 1
                seq += list(d.tokens[:n]) + [token]
        for seq in seqs:
            counts[(seq[0] * V + seq[1]) * V + seq[2]] += 1
    return PipelineResult(np.array(counts).reshape((V,) * L), np.array(accepted_hist))


RULES = ["tree_rule", "on_device"]  # the host walk of one session, the verifier's batched chain rule


def run_rule(rule: str, p_table: torch.Tensor, drafter: Drafter, n_trials: int, seed: int,
             deterministic: bool = False) -> PipelineResult:
    if rule == "on_device":
        return run_pipeline_on_device(p_table, drafter, n_trials, seed)
    return run_pipeline(p_table, drafter, rule_deterministic if deterministic else rule_sampled, n_trials, seed)


# ---------------------------------------------------------------- wrong rules

@dataclass
class _Out:
    num_accepted: int
    tokens: list[int]


def wrong_rule(bug: str) -> Rule:
    """accept_sampled with one deliberate mistake (same structure otherwise):

    no_residual     after a rejection sample p instead of norm(max(0, p - q))
    always_accept   keep every draft (then the bonus from p)
    inverted        keep x with probability min(1, q(x)/p(x))
    off_by_one      judge draft i (and its residual) against p row i+1
    bonus_wrong_row draw the bonus from p row K-1 instead of row K

    Two tempting "wrong rules" are in fact exact and therefore not listed:
    dropping the min in min(1, p/q) (u < 1 always, so u < p/q and
    u < min(1, p/q) coincide), and the point-mass rule (keep x with prob p(x),
    else sample p with x removed), which is exact whatever chose x - see
    test_point_mass_rule_is_exact_for_any_drafts.
    """
    def rule(p, draft_ids, q, g):
        k = len(draft_ids)
        pp = torch.cat([p[1:], p[-1:]]) if bug == "off_by_one" else p
        for i, x in enumerate(draft_ids):
            px, qx = float(pp[i, x]), float(q[i, x])
            u = float(torch.rand((), generator=g))
            if bug == "always_accept":
                keep = True
            elif bug == "inverted":
                keep = px > 0 and u < min(1.0, qx / px)
            else:
                keep = qx > 0 and u < min(1.0, px / qx)
            if keep:
                continue
            r = pp[i] if bug == "no_residual" else residual(pp[i], q[i])
            return _Out(i, draft_ids[:i] + [sample(r, g)])
        bonus = p[k - 1] if bug == "bonus_wrong_row" else p[k]
        return _Out(k, list(draft_ids) + [sample(bonus, g)])
    return rule


def wrong_deterministic_rule(bug: str) -> Rule:
    """accept_deterministic with one mistake:

    no_exclusion  on rejection sample p itself instead of p with x removed
    """
    assert bug == "no_exclusion"

    def rule(p, draft_ids, q, g):
        for i, x in enumerate(draft_ids):
            if float(torch.rand((), generator=g)) < float(p[i, x]):
                continue
            return _Out(i, draft_ids[:i] + [sample(p[i], g)])
        return _Out(len(draft_ids), list(draft_ids) + [sample(p[len(draft_ids)], g)])
    return rule


# ---------------------------------------------------------------- helpers

def report(name: str, fit: GoodnessOfFit, res: PipelineResult | None = None) -> None:
    extra = ""
    if res is not None:
        frac = res.accepted_hist / res.accepted_hist.sum()
        extra = "  kept/cycle " + "/".join(f"{f:.2f}" for f in frac)
    print(f"\n[{name}] {fit}{extra}", end="")


def assert_covers_all_branches(res: PipelineResult) -> None:
    """Every number of kept drafts (0 = rejection at the first position,
    1 = rejection after an acceptance, K = bonus token) occurs in at least
    2% of the cycles (hundreds of times at these trial counts)."""
    frac = res.accepted_hist / res.accepted_hist.sum()
    assert np.all(frac > 0.02), f"pipeline does not exercise every branch: {frac}"


# ---------------------------------------------------------------- tests: sampled chains

@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("params", [PLAIN, NUCLEUS, TOPK_NUCLEUS], ids=["T1", "T0.7-p0.8", "T1.3-k4-p0.9"])
@pytest.mark.statistical
def test_accept_sampled_sequences_follow_target(params, rule):
    """Speculative sampling with accept_sampled emits L-token sequences distributed
    exactly as target-only sampling with the same temperature / top-k / top-p,
    although the drafter's q is very different from p."""
    target, draft, _ = model_tables()
    p_table = logits_to_probs(target, params)
    q_table = logits_to_probs(draft, params)
    law = exact_sequence_law(p_table)
    res = run_rule(rule, p_table, sampled_drafter(q_table, seed=1), N_TRIALS, seed=2)
    fit = goodness_of_fit(res.counts, law)
    report(f"accept_sampled {rule} {params}", fit, res)
    assert_covers_all_branches(res)
    assert fit.ok, f"accept_sampled is not lossless: {fit}"


WRONG_SAMPLED = [
    # (name, sampling params, rule, how the verifier's p table is built, trials)
    ("no_residual/T1", PLAIN, "no_residual", "right", N_TRIALS_WRONG),
    ("no_residual", NUCLEUS, "no_residual", "right", N_TRIALS_WRONG),
    ("p_without_top_p", NUCLEUS, None, "no_top_p", N_TRIALS_WRONG),
    ("p_from_raw_logits", NUCLEUS, None, "raw", N_TRIALS_WRONG),
    ("always_accept", NUCLEUS, "always_accept", "right", N_TRIALS_WRONG),
    ("inverted_ratio", NUCLEUS, "inverted", "right", N_TRIALS_WRONG),
    ("off_by_one_rows", NUCLEUS, "off_by_one", "right", N_TRIALS_WRONG),
    # The subtlest: only cycles that keep both drafts from BOS put a bonus inside
    # the L=3 window (30% at T1, hence T1), so it gets the full trial count.
    ("bonus_wrong_row/T1", PLAIN, "bonus_wrong_row", "right", N_TRIALS),
]


@pytest.mark.parametrize("name,params,bug,p_kind,trials", WRONG_SAMPLED, ids=[w[0] for w in WRONG_SAMPLED])
@pytest.mark.statistical
def test_wrong_sampled_rules_are_detected(name, params, bug, p_kind, trials):
    """The same pipeline / statistic / threshold rejects each wrong rule. For the
    one-sided processing bugs (p_without_top_p: verifier applies temperature but
    forgets top-p; p_from_raw_logits: verifier applies neither) the drafter and
    the reference use the request's processing, the verifier's p does not."""
    target, draft, _ = model_tables()
    p_ref = logits_to_probs(target, params)
    if p_kind == "right":
        p_ver = p_ref
    elif p_kind == "no_top_p":
        p_ver = logits_to_probs(target, SamplingParams(temperature=params.temperature, top_k=params.top_k))
    else:
        p_ver = torch.softmax(target, -1)
    q_table = logits_to_probs(draft, params)
    rule = wrong_rule(bug) if bug else rule_sampled
    res = run_pipeline(p_ver, sampled_drafter(q_table, seed=1), rule, trials, seed=2)
    fit = goodness_of_fit(res.counts, exact_sequence_law(p_ref))
    report(f"WRONG {name}", fit, res)
    assert not fit.ok, f"the test cannot tell wrong rule {name!r} from the right one: {fit}"


# ---------------------------------------------------------------- tests: deterministic drafts

@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("params", [PLAIN, NUCLEUS], ids=["T1", "T0.7-p0.8"])
@pytest.mark.statistical
def test_accept_deterministic_sequences_follow_target(params, rule):
    """Point-mass drafts (the drafter's argmax, as an argmax drafter or n-gram
    lookup would produce) accepted with accept_deterministic are lossless too.
    The drafter's argmax is often not the target's favourite (and, under top-p,
    sometimes a token the target has removed), so all branches occur."""
    target, _, greedy_draft = model_tables()
    p_table = logits_to_probs(target, params)
    law = exact_sequence_law(p_table)
    res = run_rule(rule, p_table, argmax_drafter(greedy_draft), N_TRIALS, seed=3, deterministic=True)
    fit = goodness_of_fit(res.counts, law)
    report(f"accept_deterministic {rule} {params}", fit, res)
    assert_covers_all_branches(res)
    assert fit.ok, f"accept_deterministic is not lossless: {fit}"


@pytest.mark.statistical
def test_wrong_deterministic_rules_are_detected():
    """Forgetting to remove the rejected draft from p before resampling, and
    passing the drafter's soft distribution as q although the draft was its
    argmax (q on the wire != q the draft came from), both fail the same check."""
    target, _, greedy_draft = model_tables()
    p_table = logits_to_probs(target, NUCLEUS)
    law = exact_sequence_law(p_table)
    argmax = argmax_drafter(greedy_draft)
    res = run_pipeline(p_table, argmax, wrong_deterministic_rule("no_exclusion"), N_TRIALS_WRONG, seed=3)
    fit = goodness_of_fit(res.counts, law)
    report("WRONG deterministic no_exclusion", fit, res)
    assert not fit.ok, fit

    soft_q = RowCache(logits_to_probs(greedy_draft, NUCLEUS))

    def argmax_with_soft_q(last):
        ids, _ = argmax(last)
        return ids, soft_q[(last, *ids[:-1])]
    res = run_pipeline(p_table, argmax_with_soft_q, rule_sampled, N_TRIALS_WRONG, seed=3)
    fit = goodness_of_fit(res.counts, law)
    report("WRONG deterministic drafts + soft q", fit, res)
    assert not fit.ok, fit


@pytest.mark.statistical
def test_point_mass_rule_is_exact_for_any_drafts():
    """accept_deterministic needs no q at all: keeping x with probability p(x) and
    otherwise sampling p with x removed emits p whatever chose x, even drafts
    SAMPLED from the very different q (emit y: q(y)p(y) + sum_{x!=y} q(x)p(y) = p(y)).
    So an argmax drafter, an n-gram lookup or a sampling drafter that does not
    send q may all use it; the wrong-rule tests above cannot use it as a foil."""
    target, draft, _ = model_tables()
    p_table = logits_to_probs(target, NUCLEUS)
    sampled = sampled_drafter(logits_to_probs(draft, NUCLEUS), seed=6)

    def drafter_hiding_q(last):
        return sampled(last)[0], None
    res = run_pipeline(p_table, drafter_hiding_q, rule_deterministic, N_TRIALS_WRONG, seed=7)
    fit = goodness_of_fit(res.counts, exact_sequence_law(p_table))
    report("accept_deterministic with sampled drafts", fit, res)
    assert fit.ok, fit


# ---------------------------------------------------------------- tests: sparse truncated q

@pytest.mark.parametrize("rule", RULES)
@pytest.mark.statistical
def test_truncated_sparse_q_is_lossless(rule):
    """A drafter sampling from truncate_top(q, 3) and sending that truncated q as
    ids + probs (densified by the verifier with dense_q) stays exact; sending the
    untruncated q instead (what the draft was NOT drawn from) is detected."""
    target, draft, _ = model_tables()
    p_table = logits_to_probs(target, PLAIN)
    q_table = logits_to_probs(draft, PLAIN)
    law = exact_sequence_law(p_table)
    res = run_rule(rule, p_table, truncated_drafter(q_table, 3, seed=4), N_TRIALS, seed=5)
    fit = goodness_of_fit(res.counts, law)
    report("accept_sampled truncated top-3 sparse q", fit, res)
    assert_covers_all_branches(res)
    assert fit.ok, fit

    res = run_rule(rule, p_table, truncated_drafter(q_table, 3, seed=4, send="full"), N_TRIALS_WRONG, seed=5)
    fit = goodness_of_fit(res.counts, law)
    report("WRONG truncated draws, full q sent", fit, res)
    assert not fit.ok, fit


def test_dense_q_round_trip():
    ids, vals = truncate_top(torch.tensor([0.1, 0.4, 0.2, 0.3]), 2)
    q = dense_q([ids.tolist(), [0]], [vals.tolist(), [1.0]], 4)
    torch.testing.assert_close(q, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7], [1.0, 0.0, 0.0, 0.0]]))
    assert dense_q([], [], 5).shape == (0, 5)


# ---------------------------------------------------------------- tests: one position, directly

@pytest.mark.parametrize("rule", RULES)
@pytest.mark.statistical
def test_single_position_residual(rule):
    """One draft position, checked directly (K=1): with x ~ q,
    - the acceptance rate is sum_v min(p(v), q(v)),
    - the token emitted after a rejection follows norm(max(0, p - q)),
    - the first emitted token (kept draft or correction) follows p,
    - the rule with the residual forgotten fails the same first-token check."""
    g = torch.Generator().manual_seed(21)
    Vs = 8
    p_logits = torch.randn(Vs, generator=g) * 1.5
    p0 = torch.softmax(p_logits, -1)
    q0 = torch.softmax(-p_logits + 0.3 * torch.randn(Vs, generator=g), -1)  # q prefers what p dislikes
    p = torch.stack([p0, torch.full((Vs,), 1.0 / Vs)])  # row 1: bonus distribution
    q = q0.unsqueeze(0)
    n = 20_000
    draft_rng = TableSampler(q, seed=22)

    def simulate(rule):
        gen = torch.Generator().manual_seed(23)
        first, after_reject, kept = np.zeros(Vs), np.zeros(Vs), 0
        for _ in range(n):
            x = draft_rng(0)
            out = rule(p, [x], q, gen)
            first[out.tokens[0]] += 1
            if out.num_accepted == 1:
                kept += 1
            else:
                after_reject[out.tokens[0]] += 1
        return first, after_reject, kept

    first, after_reject, kept = simulate(rule_sampled if rule == "tree_rule" else accept_on_device)
    alpha = float(torch.minimum(p0, q0).sum())
    z = (kept - n * alpha) / math.sqrt(n * alpha * (1 - alpha))
    fit_first = goodness_of_fit(first, p0.numpy())
    fit_res = goodness_of_fit(after_reject, residual(p0, q0).numpy())
    print(f"\n[single position] acceptance {kept / n:.4f} vs {alpha:.4f} (z={z:+.2f})", end="")
    report("single position: first token ~ p", fit_first)
    report("single position: after rejection ~ residual", fit_res)
    assert abs(z) < Z_1E6
    assert fit_first.ok and fit_res.ok

    first_bad, _, _ = simulate(wrong_rule("no_residual"))
    fit_bad = goodness_of_fit(first_bad, p0.numpy())
    report("WRONG single position no_residual", fit_bad)
    assert not fit_bad.ok


@pytest.mark.statistical
def test_no_drafts_samples_p():
    """K=0: accept_sampled / accept_deterministic just sample p[0]."""
    p = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    for rule in (lambda g: accept_sampled(p, [], torch.zeros(0, 4), g),
                 lambda g: accept_deterministic(p, [], g),
                 lambda g: accept_on_device(p, [], None, g)):
        g = torch.Generator().manual_seed(5)
        counts = np.zeros(4)
        for _ in range(4000):
            out = rule(g)
            assert out.num_accepted == 0 and out.accepted_mask == [] and len(out.tokens) == 1
            counts[out.tokens[0]] += 1
        assert goodness_of_fit(counts, p[0].numpy()).ok


def test_accepted_mask_and_zero_q_draft():
    """accepted_mask marks the kept prefix; a draft whose q is 0 (it could not
    have been drawn) is rejected rather than dividing by zero."""
    p = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.5, 0.0], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        out = accept_sampled(p, [0, 1], q, g)  # draft 0 has q = 0
        assert out.num_accepted == 0 and out.accepted_mask == [False, False]
        assert out.tokens == [0]               # residual max(0, p - q) = [0.2, 0, 0]
        out = accept_sampled(p, [1, 2], q, g)  # draft 2 has p = 0 at position 1: never kept
        assert out.num_accepted in (0, 1)
        assert out.accepted_mask == [i < out.num_accepted for i in range(2)]
        if out.num_accepted == 1:
            assert out.tokens[0] == 1 and out.tokens[1] in (0, 1)
        else:
            assert out.tokens == [0]


# ---------------------------------------------------------------- tests: greedy (exact)

def _logits_with_argmax(argmaxes: list[int], vocab: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(argmaxes))
    logits = torch.randn(len(argmaxes), vocab, generator=g)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def test_accept_greedy_all_kept_plus_bonus():
    logits = _logits_with_argmax([3, 1, 4, 2])
    out = accept_greedy(logits, [3, 1, 4])
    assert out.num_accepted == 3 and out.tokens == [3, 1, 4, 2] and out.accepted_mask == [True] * 3


@pytest.mark.parametrize("j", [0, 1, 2])
def test_accept_greedy_mismatch_at_j(j):
    """Mismatch at position j: the j drafts before it are kept, then the argmax at j
    (drafts after j are discarded even if they happen to match)."""
    argmaxes = [5, 0, 6, 2]
    drafts = argmaxes[:3]
    drafts[j] = (argmaxes[j] + 1) % 7
    out = accept_greedy(_logits_with_argmax(argmaxes), drafts)
    assert out.num_accepted == j
    assert out.tokens == argmaxes[:j] + [argmaxes[j]]
    assert out.accepted_mask == [i < j for i in range(3)]


def test_accept_greedy_no_drafts():
    out = accept_greedy(_logits_with_argmax([4]), [])
    assert out.num_accepted == 0 and out.tokens == [4] and out.accepted_mask == []


def test_accept_greedy_is_sampling_limit():
    """Greedy p is one-hot, so accept_sampled with greedy p and any q gives the
    greedy result with certainty (the greedy rule is the sampling rule's limit)."""
    logits = _logits_with_argmax([2, 2, 0])
    p = logits_to_probs(logits, SamplingParams())
    q = torch.full((2, 7), 1.0 / 7)
    g = torch.Generator().manual_seed(0)
    for drafts in ([2, 2], [2, 5], [1, 2]):
        want = accept_greedy(logits, drafts)
        for _ in range(20):
            got = accept_sampled(p, drafts, q, g)
            assert (got.num_accepted, got.tokens) == (want.num_accepted, want.tokens)

"""The records of a verify batch and its phases after the forward (the
verifier core, verifier_svc/core.py, runs them in order under its lock):
plan the rows, pick each job's accepted path by its rule, attach the
features of the kept rows, compact the caches, stamp the batch's figures.
No grpc, no lock here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from specd_core.errors import CapacityExceeded
from specd_core.rules.chain_batch import ChainDraw, SparseLaw, decide_chains, to_device, uniforms
from specd_core.rules.sampling import SamplingParams, logits_to_probs
from specd_core.rules.tree import TokenTree, accept_tree_argmax, compaction_indices, finish
from specd_core.rules.tree_batch import TreeDraw, decide_trees
from specd_core.runtime.features import HiddenStates
from specd_core.runtime.grammar import Constraint, apply_masks
from specd_core.runtime.jobs import device_oom, halves
from specd_core.runtime.models import ModelSession
from specd_core.runtime.prefix_cache import publish_rows


@dataclass
class VerifyResult:
    path: list[int]  # accepted node indices, root-down
    tokens: list[int]  # path tokens + correction or bonus
    compute_ms: float  # forward + acceptance + compaction (of the whole batch it ran in)
    phases: list = field(default_factory=list)  # (name, start_ns, end_ns): forward, accept, compact
    batch_sessions: int = 1  # sessions in the same forward (verified or prefilled)
    batch_tokens: int = 0  # rows of that forward (every session's pending token + nodes)
    batch_id: int = 0  # the forward's id (Verifier._batch_ids; 0 = none)
    hidden: HiddenStates | None = None  # sessions that asked: features of the root and the kept path

    @property
    def num_accepted(self) -> int:
        return len(self.path)


class Ahead(NamedTuple):
    """A session's pending row computed before its call (verifier_svc/ahead.py),
    and the figures of the forward that computed it: a call answered from it
    reports them, as the forward its answer came from (the cost model learns
    verify costs from what calls report; an answer with no forward of its own
    would teach it that a row costs nothing)."""

    logits: torch.Tensor
    states: Any
    ms: float
    sessions: int  # of that forward, one row each
    batch_id: int


@dataclass
class VerifySession:
    cache: ModelSession
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    # The target's features it returns (EAGLE drafting), as layer ids
    # (OpenVerifySessionRequest.hidden_layers); () = none.
    hidden: tuple[int, ...] = ()
    # Structured output: the target's logits are masked to what it allows at
    # every row before the rule, and it advances only on committed tokens.
    constraint: Constraint | None = None
    # Logits and features of its pending token's row, computed before its
    # next call (verifier_svc/ahead.py); None = not run ahead.
    ahead: Ahead | None = None
    # Its next call comes straight back: its last verify carried no draft. A
    # drafting session's next verify follows the drafter's work, and the
    # gather window does not wait for it (SessionTable.active).
    comes_back: bool = True
    # Its last verify was a chain drafted right after a plain one (compact).
    probed: bool = False

    def keep_rows(self) -> None:
        """As it ends: its committed rows (every token but the pending last,
        which has no row yet) stay in the prefix cache for a next turn."""
        publish_rows(self.cache, self.tokens[:-1])


@dataclass
class VerifyJob:
    """A checked verify call, ready to join a batch."""

    session_id: str
    session: VerifySession
    tree: TokenTree
    q: list[SparseLaw] | None  # each row's draft law (the root's, then each node's) when children were sampled
    ahead: Ahead | None = None  # its row computed ahead (verifier_svc/ahead.py)

    @property
    def answered_ahead(self) -> bool:
        """Its one row was computed ahead: the batch's forward has none of it."""
        return self.ahead is not None and not self.tree.tokens


@dataclass
class OpenJob:
    """A checked OpenSession call: its prefill joins a batch like a verify."""

    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    resume: bool = False
    hidden: tuple[int, ...] = ()  # as OpenJob.hidden
    constraint: Constraint | None = None  # structured output, standing at the committed tokens
    owner: str = ""  # who opened it (SessionTable.add)
    cached: int = 0  # prompt rows taken from the prefix cache (set when admitted)


def is_chain(tree: TokenTree) -> bool:
    return all(p == i - 1 for i, p in enumerate(tree.parents))


def plan_rows(live: list[VerifyJob], admitted: list[tuple[OpenJob, VerifySession]]) -> tuple[list, list[bool]]:
    """The forward's items (cache, ids, positions, mask) and last-only flags:
    each verify's pending token and nodes (its tree as the mask: the engine
    builds every session's tree mask and positions in one go, on the device
    for the lean one; a chain's mask is the causal one; a chain whose root
    ran ahead, its nodes alone), then each prefill's
    prompt (all but the pending last token after a resume: the cache holds
    all committed tokens but the last) after the rows its cache took from
    the prefix cache."""
    items: list[tuple[ModelSession, list[int], None, TokenTree | None]] = []
    last_only = []
    for j in live:
        s = j.session
        if j.ahead is not None:  # its root's row is in the cache already: a chain goes on from it
            items.append((s.cache, list(j.tree.tokens), None, None))
        else:
            items.append((s.cache, [s.tokens[-1]] + list(j.tree.tokens), None, None if is_chain(j.tree) else j.tree))
        last_only.append(False)
    for o, s in admitted:
        rows = o.prompt_ids[:-1] if o.resume else o.prompt_ids
        items.append((s.cache, rows[s.cache.length :], None, None))
        last_only.append(True)
    return items, last_only


def masked(c: Constraint, logits: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    """The rows (root + nodes) with what the constraint forbids at -inf:
    each row masked at its node's path, the matcher moved there
    tentatively (specd_core/runtime/grammar.py)."""
    return apply_masks(logits, c.tree_masks(list(tree.tokens), list(tree.parents)))


def sampled_chains(live: list[VerifyJob], logits: list[torch.Tensor]) -> tuple[torch.Tensor, list[ChainDraw]]:
    """The sampled sessions whose draft is a chain (or none), stacked for the
    batched chain rule: their rows' law, on the device, and each one's draw
    (its uniforms from its own generator, its drafts' sparse laws)."""
    draws, row = [], 0
    for j, lg in zip(live, logits):
        n = len(j.tree.tokens)
        draws.append(ChainDraw(row, j.tree.tokens, None if j.q is None else j.q[:n], uniforms(n, j.session.generator)))
        row += lg.shape[0]
    return stacked_law([j.session.params for j in live], logits), draws


def sampled_trees(live: list[VerifyJob], logits: list[torch.Tensor]) -> tuple[torch.Tensor, list[TreeDraw]]:
    """The sampled sessions whose draft branches, stacked for the batched tree
    walk, as sampled_chains."""
    draws, row = [], 0
    for j, lg in zip(live, logits):
        draws.append(TreeDraw(row, j.tree, j.q, uniforms(len(j.tree.tokens), j.session.generator)))
        row += lg.shape[0]
    return stacked_law([j.session.params for j in live], logits), draws


def stacked_law(params: list[SamplingParams], logits: list[torch.Tensor]) -> torch.Tensor:
    """Each session's rows through logits_to_probs with its own parameters,
    stacked: one pass for all the sessions that share temperature, top-k and
    top-p (most often all of them), not one per session."""
    if not logits:
        return torch.zeros(0)
    rows = torch.cat(logits) if len(logits) > 1 else logits[0]
    groups: dict[tuple, list[int]] = {}
    r0 = 0
    for p, lg in zip(params, logits):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).extend(range(r0, r0 + lg.shape[0]))
        r0 += lg.shape[0]
    if len(groups) == 1:
        return logits_to_probs(rows, params[0])
    law = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
    for (temperature, top_k, top_p), idx in groups.items():
        at = to_device(torch.tensor(idx), rows.device)
        law[at] = logits_to_probs(rows[at], SamplingParams(temperature, top_p, top_k))
    return law


def read_back(
    greedy: list[torch.Tensor], verdicts: list[torch.Tensor]
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The greedy sessions' per-row argmaxes and each verdict table's rows
    (decide_chains', decide_trees'), in ONE transfer to the host: a step reads
    the device once, whatever its sessions."""
    parts = [torch.cat(greedy).argmax(-1) if len(greedy) > 1 else greedy[0].argmax(-1)] if greedy else []
    parts += [v.flatten() for v in verdicts if v.numel()]
    flat = (torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()) if parts else []
    best, r0 = [], 0
    for lg in greedy:
        best.append(flat[r0 : r0 + lg.shape[0]])
        r0 += lg.shape[0]
    tables = []
    for v in verdicts:
        width = v.shape[1]
        tables.append([flat[i : i + width] for i in range(r0, r0 + v.numel(), width)])
        r0 += v.numel()
    return best, tables


def accept_all(live: list[VerifyJob], logits: list[torch.Tensor]) -> list[VerifyResult]:
    """Each verify's lossless outcome from its rows' logits, masked first
    where a constraint holds: the greedy sessions' argmaxes and the sampled
    sessions' verdicts (decided on the device: specd_core/rules/chain_batch.py
    for chains, tree_batch.py for branching trees) read in one transfer."""
    logits = [
        lg if j.session.constraint is None else masked(j.session.constraint, lg, j.tree) for j, lg in zip(live, logits)
    ]
    kind = ["greedy" if j.session.params.greedy else "chain" if is_chain(j.tree) else "tree" for j in live]
    of = {k: ([j for j, x in zip(live, kind) if x == k], [lg for lg, x in zip(logits, kind) if x == k]) for k in kind}
    chains, trees = of.get("chain", ([], [])), of.get("tree", ([], []))
    best, (chain_verdicts, tree_verdicts) = read_back(
        of.get("greedy", ([], []))[1], [decide_chains(*sampled_chains(*chains)), decide_trees(*sampled_trees(*trees))]
    )
    out = {"greedy": iter(best), "chain": iter(chain_verdicts), "tree": iter(tree_verdicts)}
    return [accept(j, next(out[k]), k) for j, k in zip(live, kind)]


def accept(job: VerifyJob, verdict: list[int], kind: str) -> VerifyResult:
    """A verify's result from its verdict: a greedy session's per-row
    argmaxes (read_back), a sampled chain's [kept drafts, token]
    (decide_chains) or a sampled tree's [kept, token, path...] (decide_trees)."""
    if kind == "greedy":
        result = accept_tree_argmax(verdict, job.tree)
    else:
        kept, token = verdict[:2]
        result = finish(job.tree, verdict[2 : 2 + kept] if kind == "tree" else list(range(kept)), token)
    return VerifyResult(result.path, result.tokens, 0.0)


def attach_features(live: list[VerifyJob], accepted: list[VerifyResult], states: list, dtype: str) -> None:
    """Sessions that return features: those of the rows the cache keeps (root
    + path), the tokens committed before the new pending one."""
    for j, r, h in zip(live, accepted, states):
        if j.session.hidden:
            r.hidden = HiddenStates.encode(h[compaction_indices(r.path)], dtype)


def compact(live: list[VerifyJob], accepted: list[VerifyResult]) -> None:
    """Keep the root and the accepted path's rows; commit the tokens (the new
    last one is pending); note whether each session drafts, and whether it
    drafted a chain right after a plain call."""
    for j, r in zip(live, accepted):
        j.session.cache.compact(len(j.session.tokens) - 1, compaction_indices(r.path))
        j.session.tokens += r.tokens
        # A chain drafted right after a plain call: a session decoding plainly
        # that probes its drafter now and then (verifier_svc/ahead.py).
        j.session.probed = j.session.comes_back and bool(j.tree.tokens) and is_chain(j.tree)
        j.session.comes_back = not j.tree.tokens  # a drafting session's next verify follows the drafter
        if j.session.constraint is not None:
            j.session.constraint.commit(r.tokens)


def stamp(
    live: list[VerifyJob], accepted: list[VerifyResult], ms: float, phases: list, items: list, batch_id: int
) -> None:
    """The batch's figures on each result: its time, phases, sessions, rows
    and id; a plain call answered from its row run ahead, that forward's."""
    rows = sum(len(ids) for _, ids, _, _ in items)
    for j, r in zip(live, accepted):
        r.compute_ms, r.phases, r.batch_sessions, r.batch_tokens = ms, phases, len(items), rows
        r.batch_id = batch_id
        if (a := j.ahead) is not None and j.answered_ahead:
            r.compute_ms, r.batch_sessions, r.batch_tokens, r.batch_id = a.ms, a.sessions, a.sessions, a.batch_id


def own_layers(states, taps: tuple[int, ...], want: tuple[int, ...]):
    """One session's features from a forward that returned the states of
    `taps` side by side, (n, len(taps) * C): its own layers in its order
    (None: it returns none)."""
    if not want:
        return None
    if want == taps:
        return states
    width = states.shape[-1] // len(taps)
    return torch.cat([states[:, taps.index(t) * width : (taps.index(t) + 1) * width] for t in want], -1)


def oom_parts(jobs: list) -> list[list]:
    """How the jobs of a forward that ran the device out of memory run again:
    prefills apart from verifies first (a long prompt must not cost the
    running sessions their step), then halves."""
    opens = [j for j in jobs if isinstance(j, OpenJob)]
    verifies = [j for j in jobs if not isinstance(j, OpenJob)]
    return [verifies, opens] if verifies and opens else halves(jobs)


def out_of_memory(j, reason: str) -> CapacityExceeded:
    """The refusal of a job whose forward alone runs the device out of memory."""
    if isinstance(j, OpenJob):
        return device_oom(j.session_id, f"a prefill of {len(j.prompt_ids)} tokens", "a shorter prompt", reason)
    return device_oom(j.session_id, f"a verify of {len(j.tree.tokens)} draft tokens", "a smaller draft", reason)


def first_tokens(admitted: list[tuple[OpenJob, VerifySession]], rows: list[torch.Tensor]) -> list[int | None]:
    """Each prefill's first token from its prompt's last row (None after a
    resume: its pending token is known), masked where a constraint holds:
    the greedy ones' argmaxes and the sampled ones' draws (chains of no
    drafts) read in one transfer."""
    wanted = [(s, first_row(s, lg)) for (j, s), lg in zip(admitted, rows) if not j.resume]
    if not wanted:
        return [None] * len(admitted)
    greedy = [lg[None] for s, lg in wanted if s.params.greedy]
    sampled = [(s, lg) for s, lg in wanted if not s.params.greedy]
    law = stacked_law([s.params for s, _ in sampled], [lg[None] for _, lg in sampled])
    draws = [ChainDraw(i, (), None, uniforms(0, s.generator)) for i, (s, _) in enumerate(sampled)]
    best, (verdicts,) = read_back(greedy, [decide_chains(law, draws)])
    picked = {"greedy": iter(b[0] for b in best), "sampled": iter(token for _, token in verdicts)}
    return [None if j.resume else int(next(picked["greedy" if s.params.greedy else "sampled"])) for j, s in admitted]


def first_row(s: VerifySession, logits: torch.Tensor) -> torch.Tensor:
    """A new session's last prompt row, masked to what its constraint allows."""
    if s.constraint is None:
        return logits
    allowed = s.constraint.allowed()
    assert allowed is not None  # the empty path is never forbidden
    return apply_masks(logits, allowed)


def opened(j: OpenJob, s: VerifySession, first: int | None, states, hidden_dtype: str) -> object:
    """An open job's result (Verifier.prepare_open): its first token, which
    the session commits as its pending one, and its features if it asked."""
    if first is None:
        return (None, None) if j.hidden else None
    s.tokens.append(first)
    if s.constraint is not None:
        s.constraint.commit([first])
    return (first, HiddenStates.encode(states, hidden_dtype)) if j.hidden else first


def reserve_verify(j: VerifyJob) -> None:
    """Under the lock, before the forward: the KV blocks of the verify's rows
    (the pending token, unless its row was computed ahead, and every node),
    so that a session past the budget fails alone (CapacityExceeded),
    unchanged, and not the batch's forward."""
    nodes, committed = len(j.tree.tokens), len(j.session.tokens)
    j.session.cache.reserve(
        j.session.cache.length + (j.ahead is None) + nodes,
        f"session {j.session_id!r} (a draft of {nodes} tokens after {committed} committed)",
    )

"""The steps of one drafting batch after its sessions caught up with their
verdicts and forwarded their committed tokens (drafter_svc/core.py,
Drafter.propose_batch): guess the bonus of ahead calls (or grow their
branches, lean engine), grow the trees, and make each job's Proposal; and
what happens when they run the device out of memory (refusing_oom)."""

from __future__ import annotations

import torch

from drafter_svc.branches import Branch, BranchGroup, alternatives_that_fit, grow_branches, outcomes
from drafter_svc.state import Mark, Proposal, ProposeJob, undo_catch_up
from drafter_svc.tree_builder import Chain, DraftTree, TreeJob, grow_chains, grow_trees_batched
from specd_core.errors import CapacityExceeded
from specd_core.runtime.jobs import device_oom, halves, oom_reason
from specd_core.runtime.phases import Phases


def guess_bonus(forwards, live: list[ProposeJob], roots: list) -> dict[int, int]:
    """Ahead jobs: the logits after the last chain token are the drafter's
    prediction of the verifier's bonus token; its top choice is the guess.
    Commit it and forward it (one batched forward for all ahead jobs), so
    the next chain grows below it; roots[i] becomes the logits after it."""
    ahead = [i for i, j in enumerate(live) if j.ahead]
    guesses = {}
    for i in ahead:
        j = live[i]
        guesses[id(j)] = int(torch.argmax(roots[i][0]))
        j.session.tokens.append(guesses[id(j)])
    if ahead:
        after = forwards.forward_batch(
            [(live[i].session.cache, [live[i].session.tokens[-1]], None, None) for i in ahead], last_only=True
        )
        for i, logits in zip(ahead, after):
            roots[i] = logits
    return guesses


def grow_ahead(forwards, pairs: list, context_length: int, top_n: int, tops: int) -> dict[int, list[Branch]]:
    """Ahead jobs on the lean engine, (job, logits after the chain's last
    token): their branches, the all-kept one first, grown together. A
    session's tokens stay at the chain; the branch taken is kept later."""
    groups, out = [], {}
    for j, root in pairs:
        s, k = j.session, len(j.committed)
        n = alternatives_that_fit(j.alternatives, k, j.shape.depth, context_length - s.cache.length)
        bonus = torch.topk(root[0], n + 1).indices.tolist()
        first = len(s.tokens) - k  # the chain's first token's row (and position)
        s.branches = [
            Branch(kept, token, first + kept) for kept, token in outcomes(j.committed, s.checkpoint.last.tops, bonus, n)
        ]
        groups.append(BranchGroup(s.cache, s.params, s.generator, j.shape.depth, s.branches, j.shape.min_confidence))
        out[id(j)] = s.branches
    if groups:
        grow_branches(forwards, groups, top_n, tops)
    return out


def grow_trees(forwards, rest: list, batched: bool, top_n: int, tops: int) -> dict[int, DraftTree]:
    """The drafts of (job, root logits) pairs, by id(job). On the lean engine
    every level is one forward for all the sessions: the chains' (grow_chains)
    and the trees' (static and dynamic, grow_trees_batched); on Hugging
    Face's, trees grow one after another."""
    chains = [(j, r) for j, r in rest if batched and j.shape.is_chain]
    grown = grow_chains(
        forwards,
        [
            Chain(
                cache=j.session.cache,
                params=j.session.params,
                generator=j.session.generator,
                depth=j.shape.depth,
                root=r[0],
                min_confidence=j.shape.min_confidence,
                constraint=j.session.constraint,
                room=j.forced_room,
            )
            for j, r in chains
        ],
        top_n,
        tops,
    )
    trees = dict(zip((id(j) for j, _ in chains), grown))
    others = [(j, r) for j, r in rest if id(j) not in trees]
    jobs = [
        TreeJob(j.session.cache, r[0], j.shape, j.session.params, j.session.generator, j.session.constraint)
        for j, r in others
    ]
    trees |= dict(zip((id(j) for j, _ in others), grow_trees_batched(forwards if batched else None, jobs, top_n)))
    return trees


def proposals(
    live: list[ProposeJob],
    trees: dict[int, DraftTree],
    branched: dict[int, list[Branch]],
    guesses: dict[int, int],
    ms: float,
    phases: Phases,
) -> dict[int, Proposal]:
    """Each live job's Proposal, by id(job); the batch's figures are shared."""
    nodes = sum(len(t.tokens) for t in trees.values()) + sum(
        len(b.tree.tokens) for bs in branched.values() for b in bs[1:]
    )
    return {
        id(j): Proposal(
            tree=trees[id(j)],
            compute_ms=ms,
            phases=phases.spans,
            batch_sessions=len(live),
            batch_tokens=nodes,
            guess=guesses.get(id(j)),
            branches=branched.get(id(j), [])[1:],  # the other outcomes; the first is the proposal
        )
        for j in live
    }


def refusing_oom(draft, live: list[ProposeJob], before: dict[int, Mark], drop) -> dict:
    """{id(job): Proposal or error} of caught-up jobs drafted by draft(jobs).
    A batch whose forwards run the device out of memory (the KV cache is
    preallocated, so their activations did: a wide tree, a big batch) leaves
    nothing of them: every session goes back to its mark, and the jobs run
    again in halves. A job that does not fit even alone is refused
    (CapacityExceeded) and its session goes back to what it was before the
    call (before: its mark then), so that its client can go on without a
    draft; where that cannot be done by truncation (undo_catch_up),
    drop(job) closes the session and the refusal says so."""
    marks = [Mark.of(j.session) for j in live]
    reason = None
    try:
        return draft(live)
    except torch.OutOfMemoryError as exc:
        reason = oom_reason(exc)
    # Outside the except: its traceback's frames hold the activations.
    for j, m in zip(live, marks):
        m.restore(j.session)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the allocator's cached blocks, for the retry and whatever else needs them
    if len(live) > 1:
        return {k: r for part in halves(live) for k, r in refusing_oom(draft, part, before, drop).items()}
    j = live[0]
    if undo_catch_up(j, before[id(j)]):
        return {id(j): draft_oom(j, reason)}
    drop(j)
    gone = "; its session is closed (it had moved past what can be undone): open it again"
    return {id(j): draft_oom(j, reason, gone)}


def draft_oom(j: ProposeJob, reason: str, after: str = "") -> CapacityExceeded:
    """The refusal of a draft whose forwards alone run the device out of memory."""
    rows = max(j.shape.depth - 1, j.shape.forward_rows)
    what = f"a draft tree of depth {j.shape.depth} ({rows} rows to forward)"
    if j.ahead and j.alternatives:
        what += f" and {j.alternatives} alternatives per level ahead"
    return device_oom(j.session_id, what, "a smaller draft", reason, after)

"""A drafter session's state and the records of a Propose as it runs: the
checked call (ProposeJob), its result (Proposal), and the pure checks and
moves of a session between its calls (drafter_svc/core.py runs them).

Session invariant between calls: `tokens` are the committed ids the drafter
knows of; the cache holds a prefix of them followed by the tree nodes it
forwarded last time (`last.forwarded`). An `ahead` call keeps a checkpoint
(token count, cache length, the chain) that a `rewind` restores by
truncation alone; on the lean engine its branches' rows sit past the
checkpoint until the next call names the branch taken (drafter_svc/branches.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from drafter_svc.branches import Branch
from drafter_svc.tree_builder import DraftTree
from specd_core.errors import InvalidRequest
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.grammar import Constraint
from specd_core.runtime.models import ModelSession


@dataclass
class Proposal:
    tree: DraftTree
    compute_ms: float = 0.0
    # (name, start_ns, end_ns): forward (keep the accepted rows, forward the newly
    # committed tokens), tree (grow the draft tree, one forward per depth)
    phases: list = field(default_factory=list)
    batch_sessions: int = 1  # sessions drafted together
    batch_tokens: int = 0  # draft nodes of the whole batch
    guess: int | None = None  # ahead calls: the bonus token assumed
    branches: list[Branch] = field(default_factory=list)  # ahead calls: the other outcomes pre-drafted


@dataclass
class Checkpoint:
    """A session's state before an `ahead` call: what `rewind` restores."""

    tokens: int  # len(tokens)
    cache_length: int
    base: int
    last: DraftTree


@dataclass
class DraftSession:
    cache: ModelSession
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int]
    last: DraftTree = field(default_factory=DraftTree)
    base: int = 0  # cache rows before the last tree's nodes
    checkpoint: Checkpoint | None = None  # set while an ahead proposal is unconfirmed
    # After an ahead call on the lean engine: its outcomes, [0] = all kept. Until
    # one is taken, `tokens` end at the chain and the branches' rows follow.
    branches: list[Branch] | None = None
    target_vocab: int = 0  # the target's rows: the ids committed tokens may be (drafter_svc/vocab.py)
    # Structured output: every draft distribution is masked to what it allows
    # along the node's path; it advances only on committed tokens.
    constraint: Constraint | None = None
    logits_width: int = 0  # ids the drafter may propose: min(its rows, target_vocab)


@dataclass
class ProposeJob:
    """A checked Propose call (ProposeCall), ready to join a batch: its
    session, and its shape and forced room fitted to the drafter's limits."""

    session_id: str
    session: DraftSession
    accepted_path: list[int]
    committed: list[int]
    shape: DraftShape
    ahead: bool = False
    rewind: bool = False
    hidden: torch.Tensor | None = None  # method eagle: target features of the committed tokens, (n, C)
    alternatives: int = 0  # ahead: alternative corrections per depth to pre-draft
    branch: int = 0  # after an ahead call: the branch its verdict matched (0 = all kept)
    forced_room: int = 0  # structured output: forced nodes the chain may take besides its depth


def check_branch(s: DraftSession, rewind: bool, branch: int) -> None:
    """ahead_branch names an outcome of the last ahead call."""
    if not branch:
        return
    if rewind:
        raise InvalidRequest("ahead_branch and rewind exclude each other (a rewind drops every branch)")
    if s.checkpoint is None:
        raise InvalidRequest(f"ahead_branch {branch}: there is no ahead proposal to take a branch of")
    n = len(s.branches) if s.branches else 1
    if not 0 <= branch < n:
        raise InvalidRequest(f"ahead_branch {branch}: the last ahead proposal has branches 0..{n - 1}")


def outcome_of(s: DraftSession, rewind: bool, branch: int) -> tuple[DraftTree, int]:
    """(the draft this call's accepted_path refers to, the committed tokens
    the drafter will know before this call's own): after a rewind, the
    proposal before the ahead call; after a branched ahead call, the branch's."""
    if rewind:
        c = s.checkpoint
        assert c is not None  # prepare and check_state refuse a rewind without one
        return c.last, c.tokens
    if s.branches:
        b = s.branches[branch]
        return b.tree, b.visible + 1
    return s.last, len(s.tokens)


def check_ahead(last: DraftTree, path: list[int], committed: list[int], shape: DraftShape) -> None:
    """An ahead call follows a chain and assumes all of it kept: its path is
    the whole chain, `committed` exactly its tokens (the bonus is the guess)."""
    if not last.tokens or last.parents != list(range(-1, len(last.tokens) - 1)):
        raise InvalidRequest("ahead: the last draft must be a non-empty chain")
    if path != list(range(len(last.tokens))) or committed != last.tokens:
        raise InvalidRequest(
            "ahead: accepted_path must be the whole last chain and committed_token_ids "
            "its tokens (the bonus token is the drafter's guess)"
        )
    if not shape.is_chain:
        raise InvalidRequest("ahead: only chains are drafted ahead")


def check_outcome(t: DraftTree, path: list[int], committed: list[int]) -> None:
    """The path must run root-down through the last tree and start `committed`."""
    parent = -1
    for n in path:
        if not (0 <= n < len(t.tokens)) or t.parents[n] != parent:
            raise InvalidRequest(f"accepted_path {path} is not a root-down path of the last draft tree")
        parent = n
    if committed[: len(path)] != [t.tokens[n] for n in path]:
        raise InvalidRequest("committed_token_ids do not start with the accepted path's tokens")
    if not committed and t.tokens:
        raise InvalidRequest("committed_token_ids is empty but a draft is outstanding")


def keep_accepted(j: ProposeJob) -> None:
    """Bring a session up to the verifier's verdict (no forward): undo a
    failed ahead call, keep the accepted path's rows, learn the committed tokens."""
    s = j.session
    if j.rewind:
        # The guess failed: back to the state before the ahead call.
        # Everything it added sits past these lengths, so truncating is enough.
        c = s.checkpoint
        assert c is not None  # check_state refused a rewind without one
        del s.tokens[c.tokens :]
        s.cache.rollback(c.cache_length)
        s.base, s.last, s.branches = c.base, c.last, None
    elif s.branches:
        take_branch(s, j.branch)
    s.checkpoint = (
        Checkpoint(len(s.tokens), s.cache.length, s.base, s.last) if j.ahead else None
    )  # any other call confirms an earlier ahead
    # Keep the rows of the accepted path's forwarded nodes (ancestors are
    # forwarded first, so the offsets ascend), drop the rest of the tree.
    on_path = set(j.accepted_path)
    keep = [i for i, n in enumerate(s.last.forwarded) if n in on_path]
    if s.cache.length > s.base:
        s.cache.compact(s.base, keep) if keep else s.cache.rollback(s.base)
    commit(s, j.committed)


def commit(s: DraftSession, tokens: list[int]) -> None:
    """The session learns tokens the verifier committed."""
    s.tokens += tokens
    if s.constraint is not None:
        s.constraint.commit(tokens)


def take_branch(s: DraftSession, index: int) -> None:
    """The verdict matched this branch of the last ahead call: commit its
    kept tokens and its token, and move its rows (the token's, then its
    chain's) into place after them - no recompute; the other rows go.
    The session is then what a fresh proposal from that prefix leaves."""
    assert s.branches is not None  # called only while the session has branches
    b = s.branches[index]
    del s.tokens[b.visible :]
    s.tokens.append(b.token)
    s.cache.compact(b.visible, [r - b.visible for r in b.rows])
    s.base, s.last, s.branches = b.visible + 1, b.tree, None


# Fields some methods' caches keep beside their length (Medusa's MedusaSession:
# the verdict's length and the feature the heads read), set by a forward.
CACHE_FIELDS = ("committed", "feature")


@dataclass
class Mark:
    """What a drafting batch may change of a session, to put back in place
    when its forwards run the device out of memory: integers and references
    (the trees, checkpoint and branches are replaced, never edited), no
    tensor copied but a sampled session's generator state (a few KB on the
    host: its draws must repeat on the retry)."""

    tokens: int
    rows: int
    base: int
    last: DraftTree
    checkpoint: Checkpoint | None
    branches: list[Branch] | None
    rng: torch.Tensor | None
    fields: dict

    @classmethod
    def of(cls, s: DraftSession) -> Mark:
        rng = None if s.params.greedy else s.generator.get_state()
        fields = {f: getattr(s.cache, f) for f in CACHE_FIELDS if hasattr(s.cache, f)}
        return cls(len(s.tokens), s.cache.length, s.base, s.last, s.checkpoint, s.branches, rng, fields)

    def restore(self, s: DraftSession) -> None:
        """The session as marked; its cache only ever grew since (rows past the
        mark are dropped, as after any forward that failed part-way)."""
        del s.tokens[self.tokens :]
        s.cache.rollback(self.rows)
        s.base, s.last, s.checkpoint, s.branches = self.base, self.last, self.checkpoint, self.branches
        if self.rng is not None:
            s.generator.set_state(self.rng)
        for f, v in self.fields.items():
            setattr(s.cache, f, v)


def undo_catch_up(j: ProposeJob, before: Mark) -> bool:
    """A caught-up session (keep_accepted or a method's catch_up, nothing
    forwarded since) back to what its client saw before the call: the tokens,
    the last tree and checkpoint as they were. The rows the catch-up dropped
    are not recomputed: the last tree says it forwarded only the kept path's
    nodes, whose rows the cache holds (any later verdict keeps those of them
    on its own path, the others are forwarded again). False, nothing changed,
    where truncation cannot undo it: a rewind or a branch taken dropped or
    moved the rows of an ahead call, or a constraint moved on committed tokens."""
    s = j.session
    if j.rewind or before.branches or (s.constraint is not None and j.committed):
        return False
    on_path = set(j.accepted_path)
    kept = [n for n in before.last.forwarded if n in on_path][: max(0, s.cache.length - before.base)]
    del s.tokens[before.tokens :]
    s.base, s.checkpoint, s.branches = before.base, before.checkpoint, before.branches
    s.last = replace(before.last, forwarded=kept)
    for f, v in before.fields.items():
        setattr(s.cache, f, v)
    return True

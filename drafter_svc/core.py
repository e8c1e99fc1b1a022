"""The drafter core: per-session state and KV cache, draft trees (chains are
trees), rollback/compaction to what the verifier kept.

Session invariant between calls: `tokens` are the committed ids the drafter
knows of; the cache holds a prefix of them followed by the tree nodes it
forwarded last time (`last.forwarded`). On each Propose the cache keeps only the
accepted path's rows (in place), the committed tokens not yet cached are
forwarded, and a new tree grows below the last committed token. A draft cut
short by `shape.min_confidence` forwarded only the nodes it grew children of
(an unsure node is a leaf, never forwarded), and `last.forwarded` says which,
so nothing needs undoing: the next accepted_path indexes the proposed nodes.

Pipelined drafting (PEARL's post-verify, Liu et al. 2024): an `ahead` call
arrives while the verifier checks the last chain. It commits that chain plus the
drafter's own guess of the verifier's bonus token and drafts the next chain from
there, keeping a checkpoint (token count, cache length, the chain) so that a
`rewind` call can undo it by truncation alone when the guess was wrong.
On the lean engine it also pre-drafts likely rejection outcomes (branches.py):
all branches' rows sit past the checkpoint, and the next call names the branch
the verdict matched (`branch`), whose rows are compacted into place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from drafter_svc.branches import Branch, alternatives_that_fit, grow_branches, outcomes
from drafter_svc.config import DrafterConfig
from drafter_svc.tree_builder import DraftTree, build_tree, grow_chains
from drafter_svc.vocab import PaddedRunner, PaddedSession, substitute_id
from specd_core.errors import CapacityExceeded, InvalidRequest
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.validation import check_token_ids
from specd_core.runtime.grammar import Constraint
from specd_core.runtime.model_core import ModelCore
from specd_core.runtime.models import ModelSession
from specd_core.runtime.phases import Phases


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
class ProposeJob:
    """A checked Propose call, ready to join a batch."""

    session_id: str
    session: _Session
    accepted_path: list[int]
    committed: list[int]
    shape: DraftShape
    ahead: bool = False
    rewind: bool = False
    hidden: torch.Tensor | None = None  # method eagle: target features of the committed tokens, (n, C)
    alternatives: int = 0  # ahead: alternative corrections per depth to pre-draft
    branch: int = 0  # after an ahead call: the branch its verdict matched (0 = all kept)
    forced_room: int = 0  # structured output: forced nodes the chain may take besides its depth


@dataclass
class _Checkpoint:
    """A session's state before an `ahead` call: what `rewind` restores."""

    tokens: int  # len(tokens)
    cache_length: int
    base: int
    last: DraftTree


@dataclass
class _Session:
    cache: ModelSession
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int]
    last: DraftTree = field(default_factory=DraftTree)
    base: int = 0  # cache rows before the last tree's nodes
    checkpoint: _Checkpoint | None = None  # set while an ahead proposal is unconfirmed
    # After an ahead call on the lean engine: its outcomes, [0] = all kept. Until
    # one is taken, `tokens` end at the chain and the branches' rows follow.
    branches: list[Branch] | None = None
    target_vocab: int = 0  # the target's rows: the ids committed tokens may be (drafter_svc/vocab.py)
    # Structured output: every draft distribution is masked to what it allows
    # along the node's path; it advances only on committed tokens.
    constraint: Constraint | None = None
    logits_width: int = 0  # ids the drafter may propose: min(its rows, target_vocab)


class Drafter(ModelCore):
    role = "drafter"

    def __init__(self, config: DrafterConfig, model=None):
        super().__init__(config, model)

    def open_session(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        target_vocab_size: int = 0,
        generated_from: int = 0,
    ) -> None:
        """target_vocab_size: the target's rows (0 = the drafter's own); see drafter_svc/vocab.py.
        params.constraint: structured output; prompt_ids[generated_from:] are
        generated tokens it consumes (a rebuilt session; 0 = none)."""
        target_vocab = self._target_vocab(target_vocab_size)
        self._check_request(session_id, prompt_ids, params, target_vocab)
        matcher = self.constraint(params.constraint, prompt_ids, generated_from)
        with self._lock:
            self._check_room(session_id)
            s = self._new_session(prompt_ids, params, target_vocab)
            s.constraint = matcher
            try:
                # The prompt's KV blocks (CapacityExceeded when the budget is full).
                s.cache.reserve(len(prompt_ids), f"session {session_id!r} (a prompt of {len(prompt_ids)} tokens)")
                # Prefill now (overlaps the verifier's prefill); the last prompt token
                # is forwarded with the first proposal, which needs its logits.
                if len(prompt_ids) > 1:
                    s.cache.forward(prompt_ids[:-1], last_only=True)
            except BaseException:
                s.cache.release()  # not added: give its blocks back
                raise
            s.base = s.cache.length
            self._add(session_id, s)

    def _warm_up(self, ids: list[str], prompt: list[int], depths: list[int], timings: dict[str, float]) -> None:
        """Prefills, a chain of each depth, and chains of two sessions in one batch.
        Each call takes the draft as rejected and one token committed."""
        params = SamplingParams()
        for i in ids:
            self._timed(timings, "prefill", self.open_session, i, prompt, params)
        for n, k in enumerate(depths):
            self._timed(timings, f"draft {k} levels", self.propose, ids[0], [], [prompt[n]], DraftShape.chain(k))
        batch = [self.prepare(i, [], [prompt[0]], DraftShape.chain(depths[-1])) for i in ids]
        self._timed(timings, f"draft {len(ids)} sessions", self.propose_batch, batch)

    def _target_vocab(self, target_vocab_size: int) -> int:
        if target_vocab_size < 0:
            raise InvalidRequest(f"target_vocab_size must be >= 0 (0 = the drafter's own), got {target_vocab_size}")
        return target_vocab_size or self.vocab_size

    def _new_session(self, prompt_ids: list[int], params: SamplingParams, target_vocab: int = 0) -> _Session:
        # A distinct stream from the verifier's: draft randomness must be
        # independent of the acceptance randomness.
        gen = torch.Generator().manual_seed((params.seed * 2654435761 + 1) % 2**63)
        target_vocab = target_vocab or self.vocab_size
        cache = self.runner.new_session()
        if target_vocab != self.vocab_size:  # a padded pair: see drafter_svc/vocab.py
            cache = PaddedSession(
                cache, self.vocab_size, target_vocab, substitute_id(self.model.config, self.vocab_size)
            )
        width = min(self.vocab_size, target_vocab)
        return _Session(cache, params, gen, list(prompt_ids), target_vocab=target_vocab, logits_width=width)

    @property
    def _forwards(self) -> PaddedRunner:
        """The runner as drafting uses it: padded sessions seen through."""
        return PaddedRunner(self.runner)

    def propose(
        self,
        session_id: str,
        accepted_path: list[int],
        committed: list[int],
        shape: DraftShape,
        ahead: bool = False,
        rewind: bool = False,
        hidden=None,
        alternatives: int = 0,
        branch: int = 0,
        forced_room: int = 0,
    ) -> Proposal:
        job = self.prepare(
            session_id, accepted_path, committed, shape, ahead, rewind, hidden, alternatives, branch, forced_room
        )
        return self._alone(self.propose_batch([job]))

    def prepare(
        self,
        session_id: str,
        accepted_path: list[int],
        committed: list[int],
        shape: DraftShape,
        ahead: bool = False,
        rewind: bool = False,
        hidden=None,
        alternatives: int = 0,
        branch: int = 0,
        forced_room: int = 0,
    ) -> ProposeJob:
        """Check one Propose call (no lock, no forward): a bad call fails here,
        alone, before it could join a batch. hidden: HiddenStates (method eagle);
        alternatives / branch: ProposeRequest.ahead_alternatives / ahead_branch;
        forced_room: ProposeRequest.forced_room."""
        if not 0 <= alternatives <= self.config.max_ahead_alternatives:
            raise InvalidRequest(
                f"ahead_alternatives {alternatives} is outside [0, {self.config.max_ahead_alternatives}]"
            )
        if alternatives and not ahead:
            raise InvalidRequest("ahead_alternatives is only for ahead calls")
        if hidden is not None:
            raise InvalidRequest("hidden_states were sent to a draft_model drafter (they are for method eagle)")
        s = self._get(session_id)
        if ahead and s.constraint is not None:
            # The guess and its branches would advance the constraint on
            # tokens nobody committed; constrained sessions draft after verdicts.
            raise InvalidRequest("ahead drafting is not available to a session with structured output")
        shape.validate(self.config.max_tree_nodes, self.config.max_draft_tokens)
        if shape.dynamic and shape.top_k > min(s.logits_width, self.config.max_tree_nodes):
            # Refused here: torch.topk past the vocabulary would raise inside the
            # batch (INTERNAL, for every session in it). More candidates per node
            # than the tree may hold is never useful either.
            raise InvalidRequest(
                f"tree top_k {shape.top_k} is over the limit of {min(s.logits_width, self.config.max_tree_nodes)}"
            )
        # The target's ids: with a smaller table the drafter still takes them (vocab.py).
        check_token_ids(committed, s.target_vocab, None, "committed_token_ids", allow_empty=True)
        if rewind and s.checkpoint is None:
            raise InvalidRequest("rewind: there is no ahead proposal to undo")
        self._check_branch(s, rewind, branch)
        known = self._outcome_of(s, rewind, branch)[1]
        shape = shape.fit_rows(self.context_length - known - len(committed) - ahead)
        job = ProposeJob(
            session_id,
            s,
            list(accepted_path),
            list(committed),
            shape,
            ahead,
            rewind,
            alternatives=alternatives,
            branch=branch,
            forced_room=self._forced_room(s, forced_room, shape, known + len(committed)),
        )
        self._check_state(job)
        return job

    def _forced_room(self, s: _Session, asked: int, shape: DraftShape, tokens: int) -> int:
        """The forced nodes a chain may take: as asked, within this drafter's
        depth limit and context (the rows it forwards)."""
        if asked < 0:
            raise InvalidRequest(f"forced_room must be >= 0, got {asked}")
        if asked and s.constraint is None:
            raise InvalidRequest("forced_room is for sessions with structured output")
        if not asked or not shape.is_chain:
            return 0
        return max(
            0, min(asked, self.config.max_draft_tokens - shape.depth, self.context_length - tokens - shape.depth)
        )

    @staticmethod
    def _check_branch(s: _Session, rewind: bool, branch: int) -> None:
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

    @staticmethod
    def _outcome_of(s: _Session, rewind: bool, branch: int) -> tuple[DraftTree, int]:
        """(the draft this call's accepted_path refers to, the committed tokens
        the drafter will know before this call's own): after a rewind, the
        proposal before the ahead call; after a branched ahead call, the branch's."""
        if rewind:
            c = s.checkpoint
            assert c is not None  # prepare and _check_state refuse a rewind without one
            return c.last, c.tokens
        if s.branches:
            b = s.branches[branch]
            return b.tree, b.visible + 1
        return s.last, len(s.tokens)

    def _check_state(self, j: ProposeJob) -> None:
        """The checks that depend on the session's state. Run in prepare AND again
        under the lock before the job runs: calls of one session that arrive
        together are all prepared against the same state, and the first one to
        run changes it (e.g. a second Propose with nothing committed after a
        draft would reach the forward with no tokens, an IndexError)."""
        s = j.session
        if j.rewind and s.checkpoint is None:
            raise InvalidRequest("rewind: there is no ahead proposal to undo")
        self._check_branch(s, j.rewind, j.branch)
        last, known = self._outcome_of(s, j.rewind, j.branch)
        self._check_outcome(last, j.accepted_path, j.committed)
        if j.ahead:
            self._check_ahead(last, j.accepted_path, j.committed, j.shape)
        # The tree's forwards (not only its depth: a wide static tree forwards
        # more rows than it is deep) must fit in the context; an ahead call
        # also forwards its guess.
        if known + len(j.committed) + j.ahead + max(j.shape.depth - 1, j.shape.forward_rows) > self.context_length:
            raise InvalidRequest(
                f"a tree of depth {j.shape.depth} ({j.shape.forward_rows} rows to forward) "
                f"would pass the drafter's context length {self.context_length}"
            )

    def propose_batch(self, jobs: list[ProposeJob]) -> list[Proposal | Exception]:
        """Draft for several sessions at once: the newly committed tokens of all of
        them in ONE forward, then chains level by level, one forward per level
        for all the sessions still drafting (lean engine). Trees grow per session."""
        with self._lock:
            start, phases = time.perf_counter(), Phases()
            live, refused = self._still_valid(self._live(jobs), self._check_state)
            live, full = self._still_valid(live, self._reserve_propose, (CapacityExceeded,))
            refused |= full
            for j in live:
                self._catch_up(j)
            roots = self._root_logits(live)
            # Lean engine: ahead calls grow branches (all outcomes at once, tree
            # attention); the HF engine guesses the bonus and drafts one chain.
            batched = self.runner.lean is not None
            branched = self._grow_ahead([(j, r) for j, r in zip(live, roots) if j.ahead]) if batched else {}
            guesses = {} if batched else self._guess_bonus(live, roots)
            rest = [(j, r) for j, r in zip(live, roots) if id(j) not in branched]
            for j, _ in rest:
                j.session.base = j.session.cache.length  # the root's row is cached
            phases.mark("forward")
            trees = self._grow_trees(rest, batched)
            for j in live:
                if id(j) in branched:
                    main = branched[id(j)][0]
                    trees[id(j)], guesses[id(j)] = main.tree, main.token
                j.session.last = trees[id(j)]
            phases.mark("tree")
            ms = (time.perf_counter() - start) * 1e3
            done = self._proposals(live, trees, branched, guesses, ms, phases)
            return self._in_order(jobs, done | refused, "Propose")

    def _reserve_propose(self, j: ProposeJob) -> None:
        """The KV blocks of the rows the call may forward (an upper bound),
        reserved before anything changes, so that one session past the budget
        fails alone (CapacityExceeded), its session unchanged, and not the batch."""
        _, known = self._outcome_of(j.session, j.rewind, j.branch)
        k = len(j.committed)
        # The committed tokens, an ahead call's guess, then the tree's rows
        # or the branches' (1 + n(k+1) branches, depth rows each: branches.py).
        rows = known + k + j.ahead + max(j.shape.depth - 1, j.shape.forward_rows) + j.forced_room
        if j.ahead and j.alternatives:
            rows += (1 + j.alternatives * (k + 1)) * j.shape.depth
        j.session.cache.reserve(
            min(rows, self.context_length), f"session {j.session_id!r} (a draft after {known + k} tokens)"
        )

    def _grow_trees(self, rest: list, batched: bool) -> dict[int, DraftTree]:
        """The drafts of (job, root logits) pairs, by id(job): chains grow
        together level by level on the lean engine; the rest one by one."""
        chains = [(j, r) for j, r in rest if batched and j.shape.is_chain]
        grown = grow_chains(
            self._forwards,
            [
                (
                    j.session.cache,
                    j.session.params,
                    j.session.generator,
                    j.shape.depth,
                    r[0],
                    j.shape.min_confidence,
                    j.session.constraint,
                    j.forced_room,
                )
                for j, r in chains
            ],
            self.config.draft_top_n,
            self._tops,
        )
        trees = dict(zip((id(j) for j, _ in chains), grown))
        for j, r in rest:
            if id(j) not in trees:
                trees[id(j)] = build_tree(
                    j.session.cache,
                    r[0],
                    j.shape,
                    j.session.params,
                    self.config.draft_top_n,
                    j.session.generator,
                    j.session.constraint,
                )
        return trees

    @staticmethod
    def _proposals(
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
                trees[id(j)],
                ms,
                phases.spans,
                len(live),
                nodes,
                guesses.get(id(j)),
                branched.get(id(j), [])[1:],  # the other outcomes; the first is the proposal
            )
            for j in live
        }

    @property
    def _tops(self) -> int:
        """Ranked choices kept per chain node: an ahead call's alternatives
        plus the drafted token itself (which need not be the top one when sampled)."""
        return self.config.max_ahead_alternatives + 1

    def _grow_ahead(self, pairs: list) -> dict[int, list[Branch]]:
        """Ahead jobs on the lean engine, (job, logits after the chain's last
        token): their branches, the all-kept one first, grown together. A
        session's tokens stay at the chain; the branch taken is kept later."""
        groups, out = [], {}
        for j, root in pairs:
            s, k = j.session, len(j.committed)
            n = alternatives_that_fit(j.alternatives, k, j.shape.depth, self.context_length - s.cache.length)
            bonus = torch.topk(root[0], n + 1).indices.tolist()
            first = len(s.tokens) - k  # the chain's first token's row (and position)
            s.branches = [
                Branch(kept, token, first + kept)
                for kept, token in outcomes(j.committed, s.checkpoint.last.tops, bonus, n)
            ]
            groups.append((s.cache, s.params, s.generator, j.shape.depth, s.branches, j.shape.min_confidence))
            out[id(j)] = s.branches
        if groups:
            grow_branches(self._forwards, groups, self.config.draft_top_n, self._tops)
        return out

    def _catch_up(self, j: ProposeJob) -> None:
        """Bring a session up to the verifier's verdict (no forward): undo a
        failed ahead call, keep the accepted path's rows, learn the committed tokens."""
        s = j.session
        if j.rewind:
            # The guess failed: back to the state before the ahead call.
            # Everything it added sits past these lengths, so truncating is enough.
            c = s.checkpoint
            assert c is not None  # _check_state refused a rewind without one
            del s.tokens[c.tokens :]
            s.cache.rollback(c.cache_length)
            s.base, s.last, s.branches = c.base, c.last, None
        elif s.branches:
            self._take_branch(s, j.branch)
        s.checkpoint = (
            _Checkpoint(len(s.tokens), s.cache.length, s.base, s.last) if j.ahead else None
        )  # any other call confirms an earlier ahead
        # Keep the rows of the accepted path's forwarded nodes (ancestors are
        # forwarded first, so the offsets ascend), drop the rest of the tree.
        on_path = set(j.accepted_path)
        keep = [i for i, n in enumerate(s.last.forwarded) if n in on_path]
        if s.cache.length > s.base:
            s.cache.compact(s.base, keep) if keep else s.cache.rollback(s.base)
        s.tokens += j.committed
        if s.constraint is not None:
            s.constraint.commit(j.committed)

    @staticmethod
    def _take_branch(s: _Session, index: int) -> None:
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

    def _root_logits(self, live: list[ProposeJob]) -> list[torch.Tensor]:
        """Forward every session's committed tokens not yet cached, in one
        batch; each one's logits after its last committed token, (1, V)."""
        return self._forwards.forward_batch(
            [(j.session.cache, j.session.tokens[j.session.cache.length :], None, None) for j in live], last_only=True
        )

    def _guess_bonus(self, live: list[ProposeJob], roots: list) -> dict[int, int]:
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
            after = self._forwards.forward_batch(
                [(live[i].session.cache, [live[i].session.tokens[-1]], None, None) for i in ahead], last_only=True
            )
            for i, logits in zip(ahead, after):
                roots[i] = logits
        return guesses

    @staticmethod
    def _check_ahead(last: DraftTree, path: list[int], committed: list[int], shape: DraftShape) -> None:
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

    @staticmethod
    def _check_outcome(t: DraftTree, path: list[int], committed: list[int]) -> None:
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

"""The drafter core: per-session state and KV cache, draft trees (chains are
trees), rollback/compaction to what the verifier kept.

On each Propose (a ProposeCall, specd_core/runtime/propose_call.py) the
session catches up with the verdict: the cache keeps only the accepted path's
rows (in place), the committed tokens not yet cached are forwarded, and a new
tree grows below the last committed token. A draft cut short by
`shape.min_confidence` forwarded only the nodes it grew children of (an unsure
node is a leaf, never forwarded), and `last.forwarded` says which, so nothing
needs undoing: the next accepted_path indexes the proposed nodes. What a
session holds between calls: drafter_svc/state.py.

Pipelined drafting (PEARL's post-verify, Liu et al. 2024): an `ahead` call
arrives while the verifier checks the last chain. It commits that chain plus the
drafter's own guess of the verifier's bonus token and drafts the next chain from
there, keeping a checkpoint (token count, cache length, the chain) so that a
`rewind` call can undo it by truncation alone when the guess was wrong.
On the lean engine it also pre-drafts likely rejection outcomes (branches.py):
all branches' rows sit past the checkpoint, and the next call names the branch
the verdict matched (`branch`), whose rows are compacted into place.

How the drafter drafts (a draft model, or an EAGLE head on the target's
features) is a strategy it holds: drafter_svc/method.py, drafter_svc/eagle.py.
"""

from __future__ import annotations

import time

import torch

from drafter_svc.batch import grow_ahead, grow_trees, guess_bonus, proposals, refusing_oom
from drafter_svc.config import DrafterConfig
from drafter_svc.method import DraftMethod, DraftModel
from drafter_svc.state import (
    DraftSession,
    Mark,
    Proposal,
    ProposeJob,
    check_ahead,
    check_branch,
    check_outcome,
    outcome_of,
)
from drafter_svc.vocab import PaddedRunner, PaddedSession, substitute_id
from specd_core.errors import CapacityExceeded, InvalidRequest
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.validation import check_token_ids
from specd_core.runtime.jobs import alone, device_oom, in_order, oom_reason, still_valid
from specd_core.runtime.model_core import ModelCore
from specd_core.runtime.phases import Phases
from specd_core.runtime.propose_call import ProposeCall
from specd_core.runtime.warmup import timed, warm_up


class Drafter(ModelCore):
    """method: how it drafts (default: the model given or loaded from
    config.model_dir, a draft model; drafter_svc/eagle.py makes an EAGLE head's)."""

    def __init__(self, config: DrafterConfig, model=None, method: DraftMethod | None = None):
        self.method: DraftMethod = method or DraftModel()
        super().__init__(config, "drafter", model, self.method.runner_of, self.method.tokenizer_dir)
        if self.method.name != "draft_model":
            # An EAGLE head's rows depend on the target's features as well as
            # the tokens, which the block names do not cover: no prefix caching.
            self.kv_pool.prefix = None

    def info(self) -> dict:
        """ModelCore's report, and how this drafter drafts (its method and head)."""
        return {**super().info(), "drafting": self.method.describe()}

    def open_session(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        target_vocab_size: int = 0,
        generated_from: int = 0,
        owner: str = "",
    ) -> None:
        """target_vocab_size: the target's rows (0 = the drafter's own); see drafter_svc/vocab.py.
        params.constraint: structured output; prompt_ids[generated_from:] are
        generated tokens it consumes (a rebuilt session; 0 = none). owner: who
        opens it (Verifier.prepare_open)."""
        target_vocab = self._target_vocab(target_vocab_size)
        self.method.check_vocab(target_vocab_size, target_vocab, self.vocab_size)
        self._check_request(session_id, prompt_ids, params, target_vocab)
        self.sessions.check_owner(owner)
        matcher = self.constraint(params.constraint, prompt_ids, generated_from)
        with self.sessions.lock:
            self.sessions.check_room(session_id)
            s = self._new_session(prompt_ids, params, target_vocab)
            s.constraint = matcher
            reason = None
            try:
                self.method.prefill(s, session_id, prompt_ids)  # gives the session's blocks back if it fails
            except torch.OutOfMemoryError as exc:
                # This prompt's activations alone (the KV cache is preallocated):
                # refused like a full budget, no other session touched.
                reason = oom_reason(exc)
            if reason is not None:  # outside the except: its traceback holds the activations
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                raise device_oom(session_id, f"a prefill of {len(prompt_ids)} tokens", "a shorter prompt", reason)
            s.base = s.cache.length
            self.sessions.add(session_id, s, owner)  # idle (and owner) expiry count from now

    def warm_up(self) -> dict[str, float]:
        """Run the calls clients make before serving (specd_core/runtime/warmup.py)."""
        return warm_up(self, self._warm_up_calls)

    def _warm_up_calls(self, ids: list[str], prompt: list[int], depths: list[int], timings: dict[str, float]) -> None:
        """Prefills, a chain of each depth, and chains of two sessions in one batch.
        Each call takes the draft as rejected and one token committed. None for
        an EAGLE head: every call of a head needs the target's features, which a
        replica alone does not have (its first calls pay their one-off costs;
        the orchestrator's cost model clips them, orchestrator/cycle/adaptive.py)."""
        if not self.method.warms_up:
            return
        params = SamplingParams()
        for i in ids:
            timed(timings, "prefill", self.open_session, i, prompt, params)
        for n, k in enumerate(depths):
            call = ProposeCall(session_id=ids[0], accepted_path=[], committed=[prompt[n]], shape=DraftShape.chain(k))
            timed(timings, f"draft {k} levels", self.propose, call)
        deepest = DraftShape.chain(depths[-1])
        batch = [
            self.prepare(ProposeCall(session_id=i, accepted_path=[], committed=[prompt[0]], shape=deepest)) for i in ids
        ]
        timed(timings, f"draft {len(ids)} sessions", self.propose_batch, batch)

    def _target_vocab(self, target_vocab_size: int) -> int:
        if target_vocab_size < 0:
            raise InvalidRequest(f"target_vocab_size must be >= 0 (0 = the drafter's own), got {target_vocab_size}")
        return target_vocab_size or self.vocab_size

    def _new_session(self, prompt_ids: list[int], params: SamplingParams, target_vocab: int) -> DraftSession:
        # A distinct stream from the verifier's: draft randomness must be
        # independent of the acceptance randomness.
        gen = torch.Generator().manual_seed((params.seed * 2654435761 + 1) % 2**63)
        cache = self.runner.new_session()
        if target_vocab != self.vocab_size:  # a padded pair: see drafter_svc/vocab.py
            cache = PaddedSession(
                cache, self.vocab_size, target_vocab, substitute_id(self.model.config, self.vocab_size)
            )
        width = min(self.vocab_size, target_vocab)
        return DraftSession(cache, params, gen, list(prompt_ids), target_vocab=target_vocab, logits_width=width)

    @property
    def _forwards(self) -> PaddedRunner:
        """The runner as drafting uses it: padded sessions seen through."""
        return PaddedRunner(self.runner)

    def propose(self, call: ProposeCall) -> Proposal:
        """One call drafted alone (the servicer batches calls: prepare, propose_batch)."""
        return alone(self.propose_batch([self.prepare(call)]))

    def prepare(self, call: ProposeCall) -> ProposeJob:
        """Check one Propose call (no lock, no forward): a bad call fails here,
        alone, before it could join a batch."""
        asked, call = call, self.method.admit(call)
        if not 0 <= call.alternatives <= self.config.max_ahead_alternatives:
            raise InvalidRequest(
                f"ahead_alternatives {call.alternatives} is outside [0, {self.config.max_ahead_alternatives}]"
            )
        if call.alternatives and not call.ahead:
            raise InvalidRequest("ahead_alternatives is only for ahead calls")
        if call.hidden is not None:
            raise InvalidRequest("hidden_states were sent to a draft_model drafter (they are for method eagle)")
        s = self.sessions.get(call.session_id)
        if call.ahead and s.constraint is not None:
            # The guess and its branches would advance the constraint on
            # tokens nobody committed; constrained sessions draft after verdicts.
            raise InvalidRequest("ahead drafting is not available to a session with structured output")
        shape = self._checked_shape(call.shape, s)
        # The target's ids: with a smaller table the drafter still takes them (vocab.py).
        check_token_ids(call.committed, s.target_vocab, None, "committed_token_ids", allow_empty=True)
        if call.rewind and s.checkpoint is None:
            raise InvalidRequest("rewind: there is no ahead proposal to undo")
        check_branch(s, call.rewind, call.branch)
        known = outcome_of(s, call.rewind, call.branch)[1] + len(call.committed)
        shape = shape.fit_rows(self.context_length - known - call.ahead)
        job = ProposeJob(
            session_id=call.session_id,
            session=s,
            accepted_path=list(call.accepted_path),
            committed=list(call.committed),
            shape=shape,
            ahead=call.ahead,
            rewind=call.rewind,
            alternatives=call.alternatives,
            branch=call.branch,
            forced_room=forced_room(
                s, call.forced_room, shape, known, self.config.max_draft_tokens, self.context_length
            ),
        )
        self._check_state(job)
        return self.method.ready(job, asked)

    def _checked_shape(self, shape: DraftShape, s: DraftSession) -> DraftShape:
        """The shape within this drafter's limits, or InvalidRequest."""
        shape.validate(self.config.max_tree_nodes, self.config.max_draft_tokens)
        if shape.dynamic and shape.top_k > min(s.logits_width, self.config.max_tree_nodes):
            # Refused here: torch.topk past the vocabulary would raise inside the
            # batch (INTERNAL, for every session in it). More candidates per node
            # than the tree may hold is never useful either.
            raise InvalidRequest(
                f"tree top_k {shape.top_k} is over the limit of {min(s.logits_width, self.config.max_tree_nodes)}"
            )
        return shape

    def _check_state(self, j: ProposeJob) -> None:
        """The checks that depend on the session's state. Run in prepare AND again
        under the lock before the job runs: calls of one session that arrive
        together are all prepared against the same state, and the first one to
        run changes it (e.g. a second Propose with nothing committed after a
        draft would reach the forward with no tokens, an IndexError)."""
        s = j.session
        if j.rewind and s.checkpoint is None:
            raise InvalidRequest("rewind: there is no ahead proposal to undo")
        check_branch(s, j.rewind, j.branch)
        last, known = outcome_of(s, j.rewind, j.branch)
        check_outcome(last, j.accepted_path, j.committed)
        if j.ahead:
            check_ahead(last, j.accepted_path, j.committed, j.shape)
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
        them in ONE forward, then chains and trees level by level, one forward
        per level for all the sessions still drafting (lean engine). A job that
        runs the device out of memory even alone is refused, and the others
        get their drafts (refusing_oom)."""
        with self.sessions.lock:
            start = time.perf_counter()
            live, refused = still_valid(self.sessions.live(jobs), self._check_state)
            live, full = still_valid(live, self._reserve_propose, (CapacityExceeded,))
            refused |= full
            before = {id(j): Mark.of(j.session) for j in live}
            for j in live:
                self.method.catch_up(j)
            done = refusing_oom(lambda part: self._draft(part, start), live, before, self._drop)
            return in_order(jobs, done | refused, "Propose")

    def _draft(self, live: list[ProposeJob], start: float) -> dict[int, Proposal]:
        """The caught-up jobs' forwards and drafts: what an out-of-memory error
        undoes (every change past their catch-up is a longer cache or list, or
        a field replaced: drafter_svc/state.py, Mark)."""
        phases = Phases()
        roots = self.method.root_logits(self._forwards, live)
        # Lean engine: ahead calls grow branches (all outcomes at once, tree
        # attention); the HF engine guesses the bonus and drafts one chain.
        batched = self.runner.lean is not None
        ahead = [(j, r) for j, r in zip(live, roots) if j.ahead]
        branched = grow_ahead(self._forwards, ahead, self.context_length, *self._top_n) if batched else {}
        guesses = {} if batched else guess_bonus(self._forwards, live, roots)
        rest = [(j, r) for j, r in zip(live, roots) if id(j) not in branched]
        for j, _ in rest:
            j.session.base = j.session.cache.length  # the root's row is cached
        phases.mark("forward")
        trees = grow_trees(self._forwards, rest, batched, *self._top_n)
        for j in live:
            if id(j) in branched:
                main = branched[id(j)][0]
                trees[id(j)], guesses[id(j)] = main.tree, main.token
            j.session.last = trees[id(j)]
        phases.mark("tree")
        return proposals(live, trees, branched, guesses, (time.perf_counter() - start) * 1e3, phases)

    def _drop(self, j: ProposeJob) -> None:
        """Under the lock: close a session refused in a state it cannot be put back from."""
        self.sessions.drop(j.session_id, "the device ran out of memory for its draft")

    def _reserve_propose(self, j: ProposeJob) -> None:
        """The KV blocks of the rows the call may forward (an upper bound),
        reserved before anything changes, so that one session past the budget
        fails alone (CapacityExceeded), its session unchanged, and not the batch."""
        _, known = outcome_of(j.session, j.rewind, j.branch)
        k = len(j.committed)
        # The committed tokens, an ahead call's guess, then the tree's rows
        # or the branches' (1 + n(k+1) branches, depth rows each: branches.py).
        rows = known + k + j.ahead + max(j.shape.depth - 1, j.shape.forward_rows) + j.forced_room
        if j.ahead and j.alternatives:
            rows += (1 + j.alternatives * (k + 1)) * j.shape.depth
        j.session.cache.reserve(
            min(rows, self.context_length), f"session {j.session_id!r} (a draft after {known + k} tokens)"
        )

    @property
    def _top_n(self) -> tuple[int, int]:
        """(the top-n a sampled node's q is truncated to, the ranked choices kept
        per chain node: an ahead call's alternatives plus the drafted token
        itself, which need not be the top one when sampled)."""
        return self.config.draft_top_n, self.config.max_ahead_alternatives + 1


def forced_room(s: DraftSession, asked: int, shape: DraftShape, tokens: int, max_depth: int, context: int) -> int:
    """The forced nodes a chain may take: as asked, within the drafter's
    depth limit and context (the rows it forwards)."""
    if asked < 0:
        raise InvalidRequest(f"forced_room must be >= 0, got {asked}")
    if asked and s.constraint is None:
        raise InvalidRequest("forced_room is for sessions with structured output")
    if not asked or not shape.is_chain:
        return 0
    return max(0, min(asked, max_depth - shape.depth, context - tokens - shape.depth))

"""The verifier core: prefill, one-forward verify of a draft tree with a lossless
rule, KV compaction to the accepted path.

Session invariant: `tokens` are the committed ids (prompt + generated); the KV
cache holds all of them but the last, which is "pending" (the tree's root).
Every verify forwards [root, node0 .. node{N-1}] in ONE pass (a tree attention
mask; a chain is the tree whose mask is causal), so row 0 scores the root's
children and row i+1 node i's children. Afterwards the cache keeps the root and
the accepted path's rows, moved in place (specd_core/rules/tree.py). No grpc here.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specd_core.errors import CapacityExceeded, InvalidRequest
from specd_core.rules.sampling import SamplingParams, logits_to_probs, sample
from specd_core.rules.tree import (
    TokenTree,
    accept_tree_argmax,
    accept_tree_deterministic,
    accept_tree_sampled,
    children,
    compaction_indices,
    dense_q,
    depth,
    tree_attention,
    validate_tree,
)
from specd_core.rules.validation import check_token_ids
from specd_core.runtime.features import HiddenStates
from specd_core.runtime.grammar import Constraint, apply_masks
from specd_core.runtime.model_core import ModelCore
from specd_core.runtime.models import ModelSession, Runner
from specd_core.runtime.phases import Phases
from verifier_svc.config import VerifierConfig


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


@dataclass
class VerifyJob:
    """A checked verify call, ready to join a batch."""

    session_id: str
    session: _Session
    tree: TokenTree
    q: torch.Tensor | None  # dense per-row q when children were sampled


@dataclass
class OpenJob:
    """A checked OpenSession call: its prefill joins a batch like a verify."""

    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    resume: bool = False
    hidden: bool = False
    constraint: Constraint | None = None  # structured output, standing at the committed tokens


@dataclass
class _Session:
    cache: ModelSession
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    hidden: bool = False  # return the target's features (EAGLE drafting)
    # Structured output: the target's logits are masked to what it allows at
    # every row before the rule, and it advances only on committed tokens.
    constraint: Constraint | None = None


def is_chain(tree: TokenTree) -> bool:
    return all(p == i - 1 for i, p in enumerate(tree.parents))


class Verifier(ModelCore):
    role = "verifier"
    runner: Runner  # ModelCore's own: the verifier's forwards also return hidden states

    def __init__(self, config: VerifierConfig, model=None):
        super().__init__(config, model)
        # Forward ids from a random start: ids of two replicas do not meet.
        self._batch_ids = itertools.count(random.getrandbits(62) + 1)

    def _warm_up(self, ids: list[str], prompt: list[int], depths: list[int], timings: dict[str, float]) -> None:
        """Prefills, a verify of each depth, and one of two sessions in one forward."""
        params = SamplingParams()
        self._timed(timings, "prefill", self.verify_batch, [self.prepare_open(i, prompt, params) for i in ids])
        for k in depths:
            self._timed(timings, f"verify {k + 1} rows", self.verify, ids[0], prompt[:k])
        batch = [self.prepare(i, prompt[: depths[-1]]) for i in ids]
        self._timed(timings, f"verify {len(ids)} sessions", self.verify_batch, batch)

    @property
    def kv_tokens(self) -> int:
        """Tokens cached over all sessions (the KV pool counts the blocks they hold)."""
        # list(): a metrics scrape reads this from another thread while sessions open.
        return sum(s.cache.length for s in list(self._sessions.values()))

    def open_session(self, *args, **kwargs):
        """Prefill the prompt; return the first generated token (a plain decode
        step). Takes prepare_open's arguments. The servicer sends prepare_open's
        job through the batcher instead, so that prefills share forwards with
        each other and with verifies."""
        return self._alone(self.verify_batch([self.prepare_open(*args, **kwargs)]))

    def prepare_open(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        resume: bool = False,
        hidden: bool = False,
        generated_from: int = 0,
    ) -> OpenJob:
        """Check an OpenSession call (no lock, no forward), like `prepare`.

        resume: the session moves here from a lost verifier (orchestrator/fleet/failover.py):
        prompt_ids are all its committed tokens, the last one pending. Prefill all
        but the last and sample nothing (None), so the next verify continues
        exactly where the lost replica stood. The generator restarts from
        params.seed: the orchestrator sends a fresh seed for a resume, since
        replaying draws that made the earlier tokens would correlate with them.

        hidden: the session returns the target's features (EAGLE drafting): then
        the result is (first token, HiddenStates of every prompt token); after a
        resume (None, None) - the drafter has the earlier features already.

        params.constraint: structured output (specd_core/runtime/grammar.py); after
        a resume it consumes prompt_ids[generated_from:], the generated tokens."""
        self._check_request(session_id, prompt_ids, params)
        if resume and len(prompt_ids) < 2:
            raise InvalidRequest(
                "a resumed session needs the prompt and at least one generated token "
                f"in prompt_token_ids, got {len(prompt_ids)} token(s)"
            )
        if hidden and self.runner.lean is None:
            raise InvalidRequest("return_hidden_states needs the verifier's lean engine")
        constraint = params.constraint
        if constraint is not None and resume and not 0 < generated_from < len(prompt_ids):
            raise InvalidRequest(
                f"generated_from {generated_from} must point into the {len(prompt_ids)} prompt_token_ids "
                "of a resumed constrained session (where its generated tokens start)"
            )
        matcher = self.constraint(constraint, prompt_ids, generated_from if resume else 0)
        return OpenJob(session_id, list(prompt_ids), params, resume, hidden, matcher)

    def _admit(self, j: OpenJob, pending: int) -> _Session:
        """Under the lock: room for the session (beside `pending` sessions
        admitted to the same batch) and its prompt's KV blocks, taken now (the
        KV budget: CapacityExceeded when they are not free); the new session."""
        self._check_room(j.session_id, pending)
        gen = torch.Generator().manual_seed(j.params.seed)
        s = _Session(self.runner.new_session(), j.params, gen, list(j.prompt_ids), j.hidden, j.constraint)
        rows = len(j.prompt_ids) - 1 if j.resume else len(j.prompt_ids)
        s.cache.reserve(rows, f"session {j.session_id!r} (a prompt of {len(j.prompt_ids)} tokens)")
        return s

    def _reserve_verify(self, j: VerifyJob) -> None:
        """Under the lock, before the forward: the KV blocks of the verify's rows
        (the pending token and every node), so that a session past the budget
        fails alone (CapacityExceeded), unchanged, and not the batch's forward."""
        nodes, committed = len(j.tree.tokens), len(j.session.tokens)
        j.session.cache.reserve(
            j.session.cache.length + 1 + nodes,
            f"session {j.session_id!r} (a draft of {nodes} tokens after {committed} committed)",
        )

    def _first_token(self, j: OpenJob, s: _Session, logits: torch.Tensor, states) -> object:
        """An open job's result from its prefill's last row (see open_session)."""
        if j.resume:
            return (None, None) if j.hidden else None
        params = s.params
        if s.constraint is not None:
            allowed = s.constraint.allowed()
            assert allowed is not None  # the empty path is never forbidden
            logits = apply_masks(logits, allowed)
        first = sample(logits_to_probs(logits, params), s.generator) if not params.greedy else int(logits.argmax())
        s.tokens.append(first)
        if s.constraint is not None:
            s.constraint.commit([first])
        return (first, HiddenStates.encode(states, self.config.hidden_dtype)) if j.hidden else first

    def verify(
        self,
        session_id: str,
        draft_ids: list[int],
        parents: list[int] | None = None,
        row_dists: list[tuple[list[int], list[float]]] | None = None,
    ) -> VerifyResult:
        """ONE forward over [root] + tree; keep a lossless path; compact the cache.

        parents: None/empty = a chain. row_dists: per row (N+1; 0 = root), the
        truncated q that row's children were sampled from (empty rows for
        childless nodes); None = children chosen without sampling."""
        return self._alone(self.verify_batch([self.prepare(session_id, draft_ids, parents, row_dists)]))

    def prepare(
        self,
        session_id: str,
        draft_ids: list[int],
        parents: list[int] | None = None,
        row_dists: list[tuple[list[int], list[float]]] | None = None,
    ) -> VerifyJob:
        """Check one verify call (no lock, no forward): a bad call fails here,
        alone, before it could join a batch."""
        s = self._get(session_id)
        n = len(draft_ids)
        parents = list(parents) if parents else list(range(-1, n - 1))
        tree = validate_tree(draft_ids, parents, self.vocab_size, self.config.max_tree_nodes)
        deepest = max(depth(tree), default=0)
        if deepest > self.config.max_draft_tokens:
            raise InvalidRequest(
                f"draft depth {deepest} is over this verifier's limit of {self.config.max_draft_tokens}"
            )
        q = self._dense_q(tree, row_dists) if row_dists else None
        job = VerifyJob(session_id, s, tree, q)
        self._check_room_left(job)
        return job

    def _check_room_left(self, j: VerifyJob) -> None:
        """The context check, in prepare AND again under the lock before the job
        runs: calls of one session that arrive together are all prepared against
        the same committed length, and each one that runs first makes it longer."""
        # Every node is a row of the forward, not only the deepest path: a wide
        # tree near the end of the context would otherwise fail in the forward,
        # INTERNAL for every session of the batch.
        nodes, committed = len(j.tree.tokens), len(j.session.tokens)
        if committed + nodes > self.context_length:
            raise InvalidRequest(
                f"a draft of {nodes} nodes after {committed} committed tokens "
                f"would pass the context length {self.context_length}"
            )

    def verify_batch(self, jobs: list) -> list:
        """Run several sessions' calls in ONE forward (lean engine; the HF engine
        runs them one after another): verifies (VerifyJob) and prefills of new
        sessions (OpenJob). Each job gets its result, or the exception that
        stopped it (a session closed meanwhile, no room for a new one)."""
        with self._lock:
            start, phases = time.perf_counter(), Phases()
            opens = [j for j in jobs if isinstance(j, OpenJob)]
            live, refused = self._still_valid(
                self._live([j for j in jobs if not isinstance(j, OpenJob)]), self._check_room_left
            )
            # Verifies first: running sessions take KV blocks before new ones.
            live, full = self._still_valid(live, self._reserve_verify, (CapacityExceeded,))
            refused |= full
            admitted: list[tuple[OpenJob, _Session]] = []
            for j in opens:
                try:
                    admitted.append((j, self._admit(j, len(admitted))))
                except (InvalidRequest, CapacityExceeded) as exc:
                    refused[id(j)] = exc
            items, last_only = [], []
            for j in live:
                s, base = j.session, j.session.cache.length  # base == len(tokens) - 1
                positions = mask = None
                if not is_chain(j.tree):  # a chain's mask is the causal one
                    mask4, pos2 = tree_attention(j.tree, base)
                    mask, positions = mask4[0, 0], pos2[0]
                items.append((s.cache, [s.tokens[-1]] + list(j.tree.tokens), positions, mask))
                last_only.append(False)
            for j, s in admitted:
                # The invariant: the cache holds all committed tokens but the pending last.
                items.append((s.cache, j.prompt_ids[:-1] if j.resume else j.prompt_ids, None, None))
                last_only.append(True)
            want = any(j.session.hidden for j in live) or any(j.hidden for j in opens)
            try:
                out = self.runner.forward_batch(items, last_only=last_only, hidden=want)
            except BaseException:
                for _, new in admitted:  # never added: their blocks would be lost
                    new.cache.release()
                raise
            logits, states = out if want else (out, [None] * len(items))
            phases.mark("forward")
            done = {}
            for (j, s), lg, h in zip(admitted, logits[len(live) :], states[len(live) :]):
                done[id(j)] = self._first_token(j, s, lg[0], h)
                self._add(j.session_id, s)
            logits = [
                lg if j.session.constraint is None else self._masked(j.session.constraint, lg, j.tree)
                for j, lg in zip(live, logits[: len(live)])
            ]
            best = iter(self._argmaxes([lg for j, lg in zip(live, logits) if j.session.params.greedy]))
            accepted = [self._accept(j, lg, best) for j, lg in zip(live, logits)]
            phases.mark("accept")
            for j, r, h in zip(live, accepted, states):
                if j.session.hidden:
                    # The rows the cache keeps (root + path): the features of the
                    # tokens committed before the new pending one.
                    r.hidden = HiddenStates.encode(h[compaction_indices(r.path)], self.config.hidden_dtype)
            for j, r in zip(live, accepted):
                # Keep the root and the accepted path; the new last token is pending.
                j.session.cache.compact(len(j.session.tokens) - 1, compaction_indices(r.path))
                j.session.tokens += r.tokens
                if j.session.constraint is not None:
                    j.session.constraint.commit(r.tokens)
            phases.mark("compact")
            ms, rows = (time.perf_counter() - start) * 1e3, sum(len(ids) for _, ids, _, _ in items)
            batch_id = next(self._batch_ids)
            for r in accepted:
                r.compute_ms, r.phases, r.batch_sessions, r.batch_tokens = ms, phases.spans, len(items), rows
                r.batch_id = batch_id
            done |= {id(j): r for j, r in zip(live, accepted)}
            return self._in_order(jobs, done | refused, "verify")

    @staticmethod
    def _masked(c: Constraint, logits: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        """The rows (root + nodes) with what the constraint forbids at -inf:
        each row masked at its node's path, the matcher moved there
        tentatively (specd_core/runtime/grammar.py)."""
        return apply_masks(logits, c.tree_masks(list(tree.tokens), list(tree.parents)))

    @staticmethod
    def _argmaxes(logits: list[torch.Tensor]) -> list[list[int]]:
        """Each greedy session's per-row argmax, in one device call and one
        transfer to the host (not a host sync per session)."""
        if not logits:
            return []
        flat = torch.cat(logits).argmax(-1).tolist() if len(logits) > 1 else logits[0].argmax(-1).tolist()
        out, r0 = [], 0
        for lg in logits:
            out.append(flat[r0 : r0 + lg.shape[0]])
            r0 += lg.shape[0]
        return out

    def _accept(self, job: VerifyJob, logits: torch.Tensor, best: Iterator[list[int]]) -> VerifyResult:
        """best: the greedy sessions' argmaxes in batch order (_argmaxes),
        consumed here in the same order."""
        s, tree = job.session, job.tree
        if s.params.greedy:
            result = accept_tree_argmax(next(best), tree)
        else:
            # The rule walks the tree with host-side decisions and draws from the
            # session's CPU generator: its rows come over once, not per node.
            p = logits_to_probs(logits, s.params).cpu()
            result = (
                accept_tree_sampled(p, tree, job.q, s.generator)
                if job.q is not None
                else accept_tree_deterministic(p, tree, s.generator)
            )
        return VerifyResult(result.path, result.tokens, 0.0)

    def _dense_q(self, tree: TokenTree, rows: list[tuple[list[int], list[float]]]) -> torch.Tensor:
        """Check the sparse per-row q and densify it to (N+1, V)."""
        if len(rows) != len(tree.tokens) + 1:
            raise InvalidRequest(
                f"got {len(rows)} draft distributions for a tree of {len(tree.tokens)} "
                f"nodes (one per row: the root and each node)"
            )
        kids = children(tree)
        used: list[tuple[list[int], list[float]]] = []
        for r, (ids, probs) in enumerate(rows):
            if len(ids) != len(probs):
                raise InvalidRequest(f"draft distribution {r}: {len(ids)} ids but {len(probs)} probs")
            if not kids[r]:
                # Childless rows carry nothing, and nothing of them is read: they
                # must not reach dense_q either (an id outside the vocabulary there
                # would be an IndexError, i.e. INTERNAL).
                used.append(([], []))
                continue
            check_token_ids(ids, self.vocab_size, None, f"draft_distributions[{r}].token_ids")
            if any(not (0.0 <= p <= 1.0) for p in probs) or abs(sum(probs) - 1.0) > 1e-3:
                raise InvalidRequest(f"draft distribution {r} is not a probability distribution (sum {sum(probs):.4f})")
            if len(set(ids)) != len(ids):
                # dense_q would keep only one of the repeated entries, so the q the
                # rule uses would not sum to 1.
                raise InvalidRequest(f"draft distribution {r} lists a token id more than once")
            support = set(ids)
            missing = [tree.tokens[c] for c in kids[r] if tree.tokens[c] not in support]
            if missing:
                raise InvalidRequest(f"draft distribution {r} gives probability 0 to drafted token(s) {missing}")
            used.append((ids, probs))
        return dense_q([ids for ids, _ in used], [p for _, p in used], self.vocab_size)

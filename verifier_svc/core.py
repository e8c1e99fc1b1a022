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

import torch

from specd_core.errors import CapacityExceeded, InvalidRequest
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.tree import depth, validate_tree
from specd_core.runtime.jobs import alone, in_order, oom_reason, still_valid
from specd_core.runtime.model_core import ModelCore
from specd_core.runtime.models import Runner
from specd_core.runtime.phases import Phases
from specd_core.runtime.prefix_cache import publish_prefix, reuse_prefix
from specd_core.runtime.warmup import timed, warm_up
from verifier_svc.ahead import merge, release, runs_ahead, settle
from verifier_svc.batch import (
    OpenJob,
    VerifyJob,
    VerifyResult,
    VerifySession,
    accept_all,
    attach_features,
    compact,
    first_tokens,
    oom_parts,
    opened,
    out_of_memory,
    own_layers,
    plan_rows,
    reserve_verify,
    stamp,
)
from verifier_svc.checks import check_resume, draft_laws, feature_layers
from verifier_svc.config import VerifierConfig


class Verifier(ModelCore):
    runner: Runner  # the model's own: the verifier's forwards also return hidden states

    def __init__(self, config: VerifierConfig, model=None):
        super().__init__(config, "verifier", model)
        # Forward ids from a random start: ids of two replicas do not meet.
        self._batch_ids = itertools.count(random.getrandbits(62) + 1)
        self.plain_verifies: list[VerifyJob] = []  # the last batch's verifies whose next row runs ahead

    def warm_up(self) -> dict[str, float]:
        """Run the calls clients make before serving (specd_core/runtime/warmup.py)."""
        return warm_up(self, self._warm_up_calls)

    def _warm_up_calls(self, ids: list[str], prompt: list[int], depths: list[int], timings: dict[str, float]) -> None:
        """Prefills, a verify of each depth, and one of two sessions in one forward."""
        params = SamplingParams()
        timed(timings, "prefill", self.verify_batch, [self.prepare_open(i, prompt, params) for i in ids])
        for k in depths:
            timed(timings, f"verify {k + 1} rows", self.verify, ids[0], prompt[:k])
        batch = [self.prepare(i, prompt[: depths[-1]]) for i in ids]
        timed(timings, f"verify {len(ids)} sessions", self.verify_batch, batch)

    @property
    def kv_tokens(self) -> int:
        """Tokens cached over all sessions (the KV pool counts the blocks they hold)."""
        return sum(s.cache.length for s in self.sessions.values())

    def open_session(self, *args, **kwargs):
        """Prefill the prompt; return the first generated token (a plain decode
        step). Takes prepare_open's arguments. The servicer sends prepare_open's
        job through the batcher instead, so that prefills share forwards with
        each other and with verifies."""
        return alone(self.verify_batch([self.prepare_open(*args, **kwargs)]))

    def prepare_open(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        resume: bool = False,
        hidden: bool | tuple[int, ...] = False,
        generated_from: int = 0,
        owner: str = "",
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
        True: the last layer's output before the final norm; layer ids: the
        states entering those layers, side by side (EAGLE-3's auxiliary layers).

        params.constraint: structured output (specd_core/runtime/grammar.py); it
        consumes prompt_ids[generated_from:], the generated tokens (after a
        resume, or a resumed Generate's first open; 0 = none).

        owner: who opens it (an orchestrator's incarnation): its sessions close
        when it is not heard from for owner_timeout_s (specd_core/runtime/sessions.py)."""
        self._check_request(session_id, prompt_ids, params)
        self.sessions.heard(owner)  # checked, and word from it while the prefill waits
        check_resume(prompt_ids, resume, params.constraint is not None, generated_from)
        layers = feature_layers(hidden, len(self.runner.lean.layers) if self.runner.lean else None)
        matcher = self.constraint(params.constraint, prompt_ids, generated_from)
        return OpenJob(session_id, list(prompt_ids), params, resume, layers, matcher, owner)

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
        return alone(self.verify_batch([self.prepare(session_id, draft_ids, parents, row_dists)]))

    def prepare(
        self,
        session_id: str,
        draft_ids: list[int],
        parents: list[int] | None = None,
        row_dists: list[tuple[list[int], list[float]]] | None = None,
    ) -> VerifyJob:
        """Check one verify call (no lock, no forward): a bad call fails here,
        alone, before it could join a batch."""
        s = self.sessions.get(session_id)
        n = len(draft_ids)
        parents = list(parents) if parents else list(range(-1, n - 1))
        tree = validate_tree(draft_ids, parents, self.vocab_size, self.config.max_tree_nodes)
        deepest = max(depth(tree), default=0)
        if deepest > self.config.max_draft_tokens:
            raise InvalidRequest(
                f"draft depth {deepest} is over this verifier's limit of {self.config.max_draft_tokens}"
            )
        q = draft_laws(tree, row_dists, self.vocab_size) if row_dists else None
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
        stopped it (a session closed meanwhile, no room for a new one, a job
        that runs the device out of memory even alone: _after_oom)."""
        with self.sessions.lock:
            return self._run_batch(jobs)

    def _run_batch(self, jobs: list) -> list:
        """verify_batch under the lock, which the caller holds: the retries
        after an out-of-memory forward run here too, within the same hold
        (the lock is not reentrant)."""
        start, phases = time.perf_counter(), Phases()
        live, admitted, refused = self._admit_batch(jobs)
        fresh = [j for j in live if not j.answered_ahead]
        items, last_only = plan_rows(fresh, admitted)
        oom = None
        try:
            logits, states = self._forward(items, last_only, fresh, admitted) if items else ([], [])
        except torch.OutOfMemoryError as exc:
            # Keep only the message: the traceback's frames hold the activations
            # that filled the device, freed when this block ends, before the retry.
            oom = oom_reason(exc)
        if oom is not None:
            retried = self._after_oom(live + [o for o, _ in admitted], oom)
            return in_order(jobs, retried | refused, "verify")
        phases.mark("forward")
        done = self._open_sessions(admitted, logits[len(fresh) :], states[len(fresh) :])
        logits, states = merge(live, logits[: len(fresh)], states[: len(fresh)])
        accepted = accept_all(live, logits)
        phases.mark("accept")
        attach_features(live, accepted, states, self.config.hidden_dtype)
        compact(live, accepted)
        phases.mark("compact")
        stamp(live, accepted, (time.perf_counter() - start) * 1e3, phases.spans, items, next(self._batch_ids))
        done |= {id(j): r for j, r in zip(live, accepted)}
        self.plain_verifies = [j for j in live if runs_ahead(j)]  # for verifier_svc/ahead.py
        return in_order(jobs, done | refused, "verify")

    def _after_oom(self, jobs: list, reason: str) -> dict:
        """{id(job): result or error} of the jobs of a forward that ran the
        device out of memory (the KV cache is preallocated, so its activations
        did: a long prompt, a big batch); _forward left nothing of it. They run
        again in parts: prefills apart from verifies first (a long prompt must
        not cost the running sessions their step), then halves; a job that does
        not fit even alone is refused, and the others get their results."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the allocator's cached blocks, for whatever else needs them
        if len(jobs) == 1:
            return {id(jobs[0]): out_of_memory(jobs[0], reason)}
        return {id(j): r for part in oom_parts(jobs) for j, r in zip(part, self._run_batch(part))}

    def _admit_batch(self, jobs: list) -> tuple[list[VerifyJob], list[tuple[OpenJob, VerifySession]], dict]:
        """Under the lock: (the verifies that still stand, with their KV
        blocks taken; the prefills admitted, each its new session; {id(job):
        the error of each refused})."""
        verifies = self.sessions.live([j for j in jobs if not isinstance(j, OpenJob)])
        settle(verifies)  # the rows computed ahead: a plain verify's, or dropped
        live, refused = still_valid(verifies, self._check_room_left)
        # Verifies first: running sessions take KV blocks before new ones.
        live, full = still_valid(live, reserve_verify, (CapacityExceeded,))
        refused |= full
        release([j for j in verifies if id(j) in refused])
        admitted: list[tuple[OpenJob, VerifySession]] = []
        for j in jobs:
            if isinstance(j, OpenJob):
                try:
                    admitted.append((j, self._admit(j, len(admitted))))
                except (InvalidRequest, CapacityExceeded) as exc:
                    refused[id(j)] = exc
        return live, admitted, refused

    def _admit(self, j: OpenJob, pending: int) -> VerifySession:
        """Under the lock: room for the session (beside `pending` sessions
        admitted to the same batch) and its prompt's KV blocks, taken now (the
        KV budget: CapacityExceeded when they are not free); the new session."""
        self.sessions.check_room(j.session_id, pending)
        gen = torch.Generator().manual_seed(j.params.seed)
        s = VerifySession(self.runner.new_session(), j.params, gen, list(j.prompt_ids), j.hidden, j.constraint)
        rows = len(j.prompt_ids) - 1 if j.resume else len(j.prompt_ids)
        # Prefix caching: start after the longest cached prefix, but compute at
        # least the last row (its logits give the first token). A session that
        # returns features computes every row (the drafter needs them all).
        reusable = 0 if j.hidden else rows - 1
        j.cached = reuse_prefix(s.cache, j.prompt_ids[:rows], j.params.cache_salt, reusable)
        try:
            s.cache.reserve(rows, f"session {j.session_id!r} (a prompt of {len(j.prompt_ids)} tokens)")
        except BaseException:
            s.cache.release()  # the shared blocks it took
            raise
        return s

    def _forward(self, items: list, last_only: list[bool], live: list[VerifyJob], admitted: list) -> tuple[list, list]:
        """The batch's ONE forward: each item's logits, and its hidden states
        when any session returns features (else Nones). When it fails, nothing
        of it stays: the verified sessions' caches are as before, the new ones released."""
        wanted = [j.session.hidden for j in live] + [o.hidden for o, _ in admitted]
        taps = tuple(dict.fromkeys(t for w in wanted for t in w))  # every layer asked for, once
        lengths = [j.session.cache.length for j in live]
        try:
            out = self.runner.forward_batch(items, last_only=last_only, hidden=taps or False)
            if not taps:
                return out, [None] * len(items)
            logits, states = out
            return logits, [own_layers(h, taps, w) for h, w in zip(states, wanted)]
        except BaseException:
            # The engine moves a session's length past its new rows before the
            # last step (the LM head), and the HF engine runs sessions one by one.
            for j, n in zip(live, lengths):
                j.session.cache.rollback(n)
            for _, new in admitted:  # never added: their blocks would be lost
                new.cache.release()
            raise

    def _open_sessions(self, admitted: list, logits: list, states: list) -> dict:
        """The prefills' first tokens (by id(job)); their sessions join the table."""
        done = {}
        firsts = first_tokens(admitted, [lg[0] for lg in logits])
        for (j, s), first, h in zip(admitted, firsts, states):
            publish_prefix(s.cache)  # its prompt's rows are written now
            done[id(j)] = opened(j, s, first, h, self.config.hidden_dtype)
            self.sessions.add(j.session_id, s, j.owner)
        return done

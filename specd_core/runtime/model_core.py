"""What the drafter and verifier cores share: the loaded model and how it runs,
the session table, the lock, and the checks every new session passes."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

import torch

from specd_core.errors import CapacityExceeded, InvalidRequest, SessionExpired, UnknownSession
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.structured import OutputConstraint
from specd_core.rules.validation import check_token_ids
from specd_core.runtime.grammar import Constraint, GrammarEngine, engine_of, eos_ids, try_engine
from specd_core.runtime.hub import model_label
from specd_core.runtime.kv_budget import DEFAULT_BLOCK_ROWS, KVPool, budget_bytes
from specd_core.runtime.models import (
    ModelRunner,
    Runner,
    architecture,
    context_length,
    load_model,
    load_tokenizer,
    vocab_size,
)
from specd_core.runtime.token_text import TokenizerUnsupported

log = logging.getLogger(__name__)

# Ids of expired sessions remembered, so that a late call hears "expired" rather
# than "unknown"; bounded so that a stream of abandoned sessions cannot grow it.
EXPIRED_IDS_KEPT = 4096
MAX_SESSION_ID = 256
# active_sessions: a session with a call within this many typical call intervals
# is expected to call again soon; the moving average's weight per call.
ACTIVE_INTERVALS = 3.0
INTERVAL_EMA = 0.05
# Warm-up (ModelCore.warm_up): a prompt this long (at most), drafts this deep
# (within the replica's limit), and as many sessions as one batched forward
# of the warm-up takes. Small: on a CPU with a tiny model it is well under a
# second; on a GPU it is the first-call cost (allocator, kernel choice) paid
# once before serving instead of by the first request.
WARMUP_PROMPT_TOKENS = 16
WARMUP_DEPTHS = (1, 2, 4, 8)
WARMUP_SESSIONS = 2


class ModelCore:
    role = "model"  # "drafter" | "verifier", for messages

    def __init__(self, config, model=None):
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.model = model if model is not None else load_model(config.model_dir, config.device, config.dtype)
        self.runner: ModelRunner = Runner(self.model, config.engine)
        self.vocab_size = vocab_size(self.model)
        self.context_length = context_length(self.model.config)
        self.kv_pool = self.install_kv_pool()
        self._sessions: dict = {}
        self._touched: dict[str, float] = {}  # session id -> time.monotonic() of its last call
        self._expired: collections.OrderedDict[str, float] = collections.OrderedDict()  # id -> idle seconds
        self._call_interval_s = 0.0  # moving average of the time between a session's calls
        # Ids closed before they were opened (bounded like _expired). A caller
        # that gives up while its OpenSession is in flight closes the id at once;
        # that close can overtake the open (another thread, a queued call), and
        # without this note the open would then create a session nobody closes
        # (tests/test_cancellation.py).
        self._closed_unopened: collections.OrderedDict[str, None] = collections.OrderedDict()
        # One forward at a time: concurrent forwards on 2 CPU cores only thrash.
        # Concurrent sessions share a forward through the batcher instead
        # (specd_core/runtime/batcher.py).
        self._lock = threading.Lock()
        # Built on the first constrained session; kept, engine or reason, so a
        # tokenizer it cannot run over is read (and logged) once.
        self._grammar: GrammarEngine | TokenizerUnsupported | None = None
        self._grammar_lock = threading.Lock()

    def install_kv_pool(self) -> KVPool:
        """The replica's KV budget (specd_core/runtime/kv_budget.py), sized now that
        the weights are loaded, for the runner's sessions to take blocks from."""
        cfg = self.config
        block = getattr(cfg, "kv_block_size", DEFAULT_BLOCK_ROWS)
        nbytes = budget_bytes(getattr(cfg, "kv_cache_memory", "auto"), self.model.device)
        pool = KVPool.of_bytes(nbytes, block, self.runner.kv_row_bytes, self.role)
        self.runner.kv_pool = self.kv_pool = pool
        log.info(
            "%s KV budget: %d blocks of %d tokens (%d tokens, %.1f MiB at %d bytes per token)",
            self.role,
            pool.total_blocks,
            block,
            pool.capacity_tokens,
            pool.capacity_bytes / 2**20,
            pool.row_bytes,
        )
        return pool

    def info(self) -> dict:
        """What the replica reports of itself (ReplicaInfo): its engine, model,
        dtype and KV budget and use."""
        return {
            "model": model_label(self.config.model_dir),
            "engine": self.runner.engine,
            "architecture": architecture(self.model.config),
            "model_type": str(getattr(self.model.config, "model_type", "")),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "kv_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "sessions": self.num_sessions,
            **self.kv_pool.describe(),
        }

    def warm_up(self) -> dict[str, float]:
        """Run the forwards this replica's batcher will run (a prefill, verify
        or draft calls of a few depths, a batch of two sessions), through the
        same calls clients make, before it serves: the first forward of each
        shape pays one-off costs (lazy initialisation, allocations, kernel
        selection) that would otherwise land on the first request - and in the
        orchestrator's adaptive cost model, which would learn from them that
        drafting is dear (orchestrator/cycle/adaptive.py). Returns the ms each
        step took (logged). A failure is logged, not raised: warm-up only
        saves time, and the replica still serves."""
        n = max(2, min(WARMUP_PROMPT_TOKENS, self.context_length // 4))
        prompt = [(7 * i + 3) % self.vocab_size for i in range(n)]
        depths = [k for k in WARMUP_DEPTHS if k <= min(self.config.max_draft_tokens, self.context_length // 8)]
        ids = [f"specd-warmup-{i}" for i in range(WARMUP_SESSIONS)]
        timings: dict[str, float] = {}
        start = time.perf_counter()
        try:
            self._warm_up(ids, prompt, depths or [1], timings)
        except Exception:  # noqa: BLE001 - see the docstring
            log.warning("%s warm-up failed; serving without it", self.role, exc_info=True)
        finally:
            for sid in ids:
                if sid in self._sessions:
                    self.close_session(sid)
            # The warm-up's calls came back to back: their interval would make
            # real sessions look idle to the batcher's gather window for a while.
            self._call_interval_s = 0.0
        log.info(
            "%s warmed up in %.0f ms: %s",
            self.role,
            (time.perf_counter() - start) * 1e3,
            ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items()),
        )
        return timings

    def _warm_up(self, ids: list[str], prompt: list[int], depths: list[int], timings: dict[str, float]) -> None:
        """The role's own warm-up calls, each timed into timings (warm_up)."""

    @staticmethod
    def _timed(timings: dict[str, float], name: str, call, *args) -> None:
        """Run call(*args); a batch's results may hold its exceptions: raise those."""
        start = time.perf_counter()
        out = call(*args)
        timings[name] = (time.perf_counter() - start) * 1e3
        for r in out if isinstance(out, list) else ():
            if isinstance(r, Exception):
                raise r

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def active_sessions(self) -> int:
        """Open sessions expected to call soon: those with a call within the last
        ACTIVE_INTERVALS typical intervals between a session's calls (the
        batcher's gather window waits for these; specd_core/runtime/batcher.py). A session
        stalled by a slow client drops out, so it makes no batch wait."""
        since = time.monotonic() - ACTIVE_INTERVALS * self._call_interval_s
        return sum(1 for sid, t in list(self._touched.items()) if t >= since and sid in self._sessions)

    def tokenizer_dir(self) -> str:
        """Where the tokenizer that structured output masks with is read from."""
        return self.config.model_dir

    @property
    def grammar(self) -> GrammarEngine:
        """The structured-output engine over this model's tokenizer, built once
        (reading the tokenizer takes about a second)."""
        with self._grammar_lock:
            if self._grammar is None:
                try:
                    tokenizer = load_tokenizer(self.tokenizer_dir())
                except (OSError, ValueError) as exc:
                    raise InvalidRequest(
                        f"structured output needs the model's tokenizer, and the {self.role} could not load one "
                        f"from {self.tokenizer_dir()!r}: {exc}"
                    ) from None
                self._grammar = try_engine(tokenizer, eos_ids(self.model.config, tokenizer))
            return engine_of(self._grammar)

    def constraint(
        self, c: OutputConstraint | None, prompt_ids: Sequence[int] = (), generated_from: int = 0
    ) -> Constraint | None:
        """A new session's constraint (None: unconstrained), standing after
        the generated tokens prompt_ids[generated_from:] (a rebuilt session's;
        0 = none generated); InvalidRequest for a bad constraint."""
        if c is None:
            return None
        if not 0 <= generated_from <= len(prompt_ids):
            raise InvalidRequest(f"generated_from {generated_from} is outside the {len(prompt_ids)} prompt_token_ids")
        generated = list(prompt_ids[generated_from:]) if generated_from else []
        return self.grammar.constraint(c, self.vocab_size, generated)

    def _check_request(
        self, session_id: str, prompt_ids: list[int], params: SamplingParams, vocab_size: int | None = None
    ) -> None:
        """The input checks of a new session (no lock needed). vocab_size: the
        ids the prompt may hold (default: this model's rows)."""
        params.validate()
        if not session_id:
            raise InvalidRequest("session_id must not be empty")
        if len(session_id) > MAX_SESSION_ID:  # ids are held in tables and echoed in messages and logs
            raise InvalidRequest(f"session_id has {len(session_id)} characters; at most {MAX_SESSION_ID} are allowed")
        check_token_ids(prompt_ids, vocab_size or self.vocab_size, self.context_length, "prompt_token_ids")

    def _check_room(self, session_id: str, pending: int = 0) -> None:
        """Under the lock: the id is new and the session table has room (beside
        `pending` sessions admitted to the same batch but not yet added)."""
        if session_id in self._sessions:
            raise InvalidRequest(f"session {session_id!r} is already open")
        if session_id in self._closed_unopened:
            del self._closed_unopened[session_id]
            raise InvalidRequest(
                f"session {session_id!r} was closed before it was opened (its caller gave up "
                f"on it); open it under a new id"
            )
        if len(self._sessions) + pending >= self.config.max_sessions:
            raise CapacityExceeded(f"{self.role} is at its limit of {self.config.max_sessions} sessions")

    def _add(self, session_id: str, session) -> None:
        """Under the lock: register a new session (and forget an old expiry of its id)."""
        self._sessions[session_id] = session
        self._touched[session_id] = time.monotonic()
        self._expired.pop(session_id, None)

    @staticmethod
    def _free(session) -> None:
        """What a closed session held, freed now: its KV blocks go back to the
        pool, its structured-output matcher goes. A job of the session still in
        a batch (or in a frame an exception kept) may outlive it by a while; what
        it holds must not."""
        session.cache.release()
        if getattr(session, "constraint", None) is not None:
            session.constraint = None

    def close_session(self, session_id: str) -> None:
        with self._lock:
            self._touched.pop(session_id, None)
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self._free(session)
            else:
                if session_id not in self._expired:
                    self._closed_unopened[session_id] = None
                    while len(self._closed_unopened) > EXPIRED_IDS_KEPT:
                        self._closed_unopened.popitem(last=False)
                self._raise_missing(session_id)

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Close the sessions without a call for `session_idle_timeout_s` (their KV
        cache goes with them); return their ids. A client that vanished without
        closing (crashed orchestrator, lost close) must not hold memory forever."""
        timeout = self.config.session_idle_timeout_s
        if timeout <= 0:
            return []
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [sid for sid in self._sessions if now - self._touched.get(sid, now) > timeout]
            for sid in stale:
                self._free(self._sessions.pop(sid))
                self._expired[sid] = now - self._touched.pop(sid)
            for sid in [sid for sid in list(self._touched) if sid not in self._sessions]:
                self._touched.pop(sid, None)  # left by a call racing its session's close
            while len(self._expired) > EXPIRED_IDS_KEPT:
                self._expired.popitem(last=False)
        for sid in stale:
            log.info("%s session %r expired after %.0f s idle", self.role, sid, self._expired.get(sid, timeout))
        return stale

    def _raise_missing(self, session_id: str):
        idle = self._expired.get(session_id)
        if idle is not None:
            raise SessionExpired(
                f"session {session_id!r} expired: no call for {idle:.1f} s (this {self.role}'s "
                f"session_idle_timeout_s is {self.config.session_idle_timeout_s:g}); "
                f"open a new session"
            )
        raise UnknownSession(f"unknown session id {session_id!r}")

    def _live(self, jobs: list) -> list:
        """The jobs (checked calls) whose session is still the one they were
        checked against: not closed while they waited for their batch."""
        return [j for j in jobs if self._sessions.get(j.session_id) is j.session]

    @staticmethod
    def _still_valid(jobs: list, check, errors: tuple[type[Exception], ...] = (InvalidRequest,)) -> tuple[list, dict]:
        """Under the lock: (the jobs that pass check(job) now, {id(job): the
        error of each that does not}); `errors` are the failures that refuse
        one job alone (a bad call; a session past the KV budget), not the batch."""
        ok, refused = [], {}
        for j in jobs:
            try:
                check(j)
                ok.append(j)
            except errors as exc:
                refused[id(j)] = exc
        return ok, refused

    @staticmethod
    def _alone(results: list):
        """A batch of one job run directly (not through the batcher): its
        result, or the exception that stopped it, raised."""
        if isinstance(results[0], Exception):
            raise results[0]
        return results[0]

    @staticmethod
    def _in_order(jobs: list, done: dict, call: str) -> list:
        """Each job's result (done: id(job) -> result), or UnknownSession for a job
        whose session was closed during its call."""
        return [
            done[id(j)]
            if id(j) in done
            else UnknownSession(f"session {j.session_id!r} was closed during its {call} call")
            for j in jobs
        ]

    def _get(self, session_id: str):
        s = self._sessions.get(session_id)
        if s is None:
            self._raise_missing(session_id)
        # Plain dict stores, atomic under the GIL; a stale entry left by a
        # session closed meanwhile is ignored and dropped by expire_idle.
        now = time.monotonic()
        last = self._touched.get(session_id)
        self._touched[session_id] = now
        if last is not None:  # a moving average over all sessions' calls (races only blur it)
            ema = self._call_interval_s
            # Clipped: one session back after a long stall must not make every
            # other session look active for minutes.
            self._call_interval_s = (now - last) if ema == 0 else ema + INTERVAL_EMA * (min(now - last, 4 * ema) - ema)
        return s

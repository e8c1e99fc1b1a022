"""A replica's session table, held by the drafter and verifier cores: the open
sessions, the lock their forwards run under, admission of a new id, idle
expiry, the expiry of a vanished owner's sessions, and what a late or unknown
id is told. What a session is (its cache,
its tokens) is the core's; the table only needs `session.cache.release()`,
an optional `session.constraint` and an optional `session.comes_back`."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from specd_core.errors import CapacityExceeded, InvalidRequest, SessionExpired, UnknownSession

log = logging.getLogger(__name__)

# Ids of expired sessions remembered, so that a late call hears "expired" rather
# than "unknown"; bounded so that a stream of abandoned sessions cannot grow it.
EXPIRED_IDS_KEPT = 4096
# active(): a session with a call within this many typical call intervals
# is expected to call again soon; the moving average's weight per call.
ACTIVE_INTERVALS = 3.0
INTERVAL_EMA = 0.05
MAX_OWNER = 256  # characters of an owner's name (held in tables, echoed in logs)


class SessionTable:
    """Sessions by id. `lock`: one forward at a time (concurrent forwards on 2
    CPU cores only thrash; concurrent sessions share a forward through the
    batcher instead, specd_core/runtime/batcher.py); adding, closing and
    expiring take it too."""

    def __init__(self, role: str, max_sessions: int, idle_timeout_s: float, owner_timeout_s: float = 0.0):
        self.role, self.max_sessions, self.idle_timeout_s = role, max_sessions, idle_timeout_s
        self.owner_timeout_s = owner_timeout_s
        self.lock = threading.Lock()
        self._sessions: dict = {}
        self._touched: dict[str, float] = {}  # session id -> time.monotonic() of its last call
        # Owned sessions (opened with an owner: an orchestrator's incarnation)
        # and when each owner was last heard from (a call, a keep-alive).
        self._owner_of: dict[str, str] = {}
        self._heard: dict[str, float] = {}
        self._expired: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why it expired
        # Told (reason "idle" | "owner", how many) when sessions expire (a metric).
        self.on_expired: Callable[[str, int], None] | None = None
        self.call_interval_s = 0.0  # moving average of the time between a session's calls
        # Ids closed before they were opened (bounded like _expired). A caller
        # that gives up while its OpenSession is in flight closes the id at once;
        # that close can overtake the open (another thread, a queued call), and
        # without this note the open would then create a session nobody closes
        # (tests/test_cancellation.py).
        self._closed_unopened: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __getitem__(self, session_id: str):
        """The session, without counting a call (for reading its state)."""
        return self._sessions[session_id]

    def values(self) -> list:
        # A copy: a metrics scrape reads this from another thread while sessions open.
        return list(self._sessions.values())

    def active(self) -> int:
        """Open sessions expected to call soon: those with a call within the last
        ACTIVE_INTERVALS typical intervals between a session's calls (the
        batcher's gather window waits for these; specd_core/runtime/batcher.py). A session
        stalled by a slow client drops out, so it makes no batch wait; so does
        one whose `comes_back` is False (its next call follows another
        service's work: docs/architecture.md, "The gather window")."""
        since = time.monotonic() - ACTIVE_INTERVALS * self.call_interval_s
        sessions = self._sessions
        return sum(
            1
            for sid, t in list(self._touched.items())
            if t >= since and (s := sessions.get(sid)) is not None and getattr(s, "comes_back", True)
        )

    def batch_share(self) -> int:
        """How many verifies of open sessions one batch takes (the batcher's
        split, specd_core/runtime/batcher.py): every session whose next call
        comes straight back, and half of those whose `comes_back` is False,
        rounded up, so that the drafting sessions take turns in two halves.
        Counted over the open sessions, not the recent callers: a count that
        moved with each call's timing split the batches unevenly."""
        back = away = 0
        for s in list(self._sessions.values()):
            if getattr(s, "comes_back", True):
                back += 1
            else:
                away += 1
        return back + (away + 1) // 2

    def check_room(self, session_id: str, pending: int = 0) -> None:
        """Under the lock: the id is new and the table has room (beside
        `pending` sessions admitted to the same batch but not yet added)."""
        if session_id in self._sessions:
            raise InvalidRequest(f"session {session_id!r} is already open")
        if session_id in self._closed_unopened:
            del self._closed_unopened[session_id]
            raise InvalidRequest(
                f"session {session_id!r} was closed before it was opened (its caller gave up "
                f"on it); open it under a new id"
            )
        if len(self._sessions) + pending >= self.max_sessions:
            raise CapacityExceeded(f"{self.role} is at its limit of {self.max_sessions} sessions")

    def add(self, session_id: str, session, owner: str = "") -> None:
        """Under the lock: register a new session (and forget an old expiry of
        its id); owner: who opened it ("" = nobody in particular: only the idle
        rule applies)."""
        now = time.monotonic()
        self._sessions[session_id] = session
        self._touched[session_id] = now
        self._expired.pop(session_id, None)
        if owner:
            self._owner_of[session_id] = owner
            self._heard[owner] = now

    @staticmethod
    def check_owner(owner: str) -> None:
        if len(owner) > MAX_OWNER:
            raise InvalidRequest(f"owner has {len(owner)} characters; at most {MAX_OWNER} are allowed")

    def heard(self, owner: str) -> int:
        """An owner is alive (its keep-alive): its sessions' clock restarts.
        Returns how many sessions it has open here. No lock: plain stores, as in `get`."""
        self.check_owner(owner)
        if not owner:
            return 0
        self._heard[owner] = time.monotonic()
        return sum(1 for o in list(self._owner_of.values()) if o == owner)

    def pardon_owners(self) -> None:
        """Every owner counts as heard from now: this replica itself was not
        running (stopped, paused, starved), so the silence it measured is
        partly its own, and a live owner's keep-alives may still be queued."""
        now = time.monotonic()
        for owner in list(self._heard):
            self._heard[owner] = now

    @staticmethod
    def _free(session) -> None:
        """What a closed session held, freed now: its KV blocks go back to the
        pool, its structured-output matcher goes. A job of the session still in
        a batch (or in a frame an exception kept) may outlive it by a while; what
        it holds must not. A session that can keeps its rows' full blocks in
        the prefix cache first (VerifySession.keep_rows)."""
        keep = getattr(session, "keep_rows", None)
        if keep is not None:
            keep()
        session.cache.release()
        if getattr(session, "constraint", None) is not None:
            session.constraint = None

    def close(self, session_id: str) -> None:
        with self.lock:
            self._touched.pop(session_id, None)
            self._owner_of.pop(session_id, None)
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
        """Close the sessions without a call for `idle_timeout_s` (their KV
        cache goes with them); return their ids. A client that vanished without
        closing (crashed orchestrator, lost close) must not hold memory forever."""
        timeout = self.idle_timeout_s
        if timeout <= 0:
            return []
        now = time.monotonic() if now is None else now
        with self.lock:
            stale = {sid: now - self._touched.get(sid, now) for sid in self._sessions}
            stale = {sid: idle for sid, idle in stale.items() if idle > timeout}
            for sid, idle in stale.items():
                self._drop(sid, f"no call for {idle:.1f} s (this {self.role}'s session_idle_timeout_s is {timeout:g})")
            for sid in [sid for sid in list(self._touched) if sid not in self._sessions]:
                self._touched.pop(sid, None)  # left by a call racing its session's close
        for sid, idle in stale.items():
            log.info("%s session %r expired after %.0f s idle", self.role, sid, idle)
        self._count("idle", len(stale))
        return list(stale)

    def expire_orphans(self, now: float | None = None) -> list[str]:
        """Close the sessions of every owner not heard from for
        `owner_timeout_s` (an orchestrator that died: a restarted one is a new
        owner); return their ids. Sessions without an owner are not touched."""
        timeout = self.owner_timeout_s
        if timeout <= 0:
            return []
        now = time.monotonic() if now is None else now
        with self.lock:
            gone = {o: now - t for o, t in list(self._heard.items()) if now - t > timeout}
            stale = [(sid, o) for sid, o in list(self._owner_of.items()) if o in gone]
            for sid, owner in stale:
                why = f"its owner {owner!r} was not heard from for {gone[owner]:.1f} s"
                self._drop(sid, f"{why} (this {self.role}'s owner_timeout_s is {timeout:g})")
            for owner in gone:  # none of its sessions is left
                del self._heard[owner]
        for owner, closed in collections.Counter(o for _, o in stale).items():
            log.warning(
                "%s closed %d session(s) of %r: not heard from for %.1f s (owner_timeout_s %g)",
                self.role,
                closed,
                owner,
                gone[owner],
                timeout,
            )
        self._count("owner", len(stale))
        return [sid for sid, _ in stale]

    def drop(self, session_id: str, why: str) -> None:
        """Under the lock: close a session its core cannot keep, noting why for its late calls."""
        self._drop(session_id, why)

    def _drop(self, session_id: str, why: str) -> None:
        """Under the lock: close a session the table expires itself, noting why
        for its late calls."""
        self._free(self._sessions.pop(session_id))
        self._touched.pop(session_id, None)
        self._owner_of.pop(session_id, None)
        self._expired[session_id] = why
        while len(self._expired) > EXPIRED_IDS_KEPT:
            self._expired.popitem(last=False)

    def _count(self, reason: str, n: int) -> None:
        if n and self.on_expired is not None:
            self.on_expired(reason, n)

    def _raise_missing(self, session_id: str):
        why = self._expired.get(session_id)
        if why is not None:
            raise SessionExpired(f"session {session_id!r} expired: {why}; open a new session")
        raise UnknownSession(f"unknown session id {session_id!r}")

    def live(self, jobs: list) -> list:
        """The jobs (checked calls) whose session is still the one they were
        checked against: not closed while they waited for their batch."""
        return [j for j in jobs if self._sessions.get(j.session_id) is j.session]

    def get(self, session_id: str):
        """The session of a call (counted as a call: idle expiry and the
        batcher's active count read it)."""
        s = self._sessions.get(session_id)
        if s is None:
            self._raise_missing(session_id)
        # Plain dict stores, atomic under the GIL; a stale entry left by a
        # session closed meanwhile is ignored and dropped by expire_idle.
        now = time.monotonic()
        last = self._touched.get(session_id)
        self._touched[session_id] = now
        owner = self._owner_of.get(session_id)
        if owner is not None:  # a call of the owner's is word from it
            self._heard[owner] = now
        if last is not None:  # a moving average over all sessions' calls (races only blur it)
            ema = self.call_interval_s
            # Clipped: one session back after a long stall must not make every
            # other session look active for minutes.
            self.call_interval_s = (now - last) if ema == 0 else ema + INTERVAL_EMA * (min(now - last, 4 * ema) - ema)
        return s

"""A discrete-event model of the serving path: S closed-loop streams over N
orchestrators, D drafter and V verifier replicas (docs/capacity.md).

Every process is a server that takes everything queued for it when it frees
up and works on it as ONE step, whose work is `fixed + per_session × sessions`:

- a verifier or drafter replica runs one forward per step over the calls
  queued (at most `max_batch`), after waiting for the other active sessions'
  calls at most `wait_fraction` of its last step's time: the services'
  batcher and its gather window (specd_core/runtime/batcher.py); it answers with
  one message per orchestrator whose sessions were in the step;
- a new request opens its session with a unary OpenSession per replica: the
  verifier's prefill joins its next forward, the drafter answers at once; the
  session's first call leaves when both have answered, at its own phase, so
  sessions form groups that take turns and merge only through the gather
  window; at the last verdict a unary CloseSession goes to each replica;
- an orchestrator takes every batched message that arrived (service replies),
  handles their sessions (a pass each: two per cycle with a
  drafter service, one without) and sends one message per replica that has
  sessions to go to it: sessions ready at the same moment ride in one message.
  Its fixed cost is per message in or out. `transport="per_session"` models
  the earlier design instead: a message per session's call and answer,
  handled one at a time, so a step's sessions reach the next service one by
  one;
- the load generator (the benchmark's own process, when it shares the
  machine) reads each cycle's streamed tokens; a stream's next request starts
  once it has read the last one.

Processes run on machines: each machine's cores are shared by its busy
processes (egalitarian processor sharing, at most one core each: a step is
serial work). On one CPU box everything shares its cores; in a GPU deployment
each service replica has its own device and only the orchestrators share the
head node's cores. A request opens its session (a prefill in the verifier's forward)
before its first call and joins the group it lands in; the prefill's extra
cost is in the per-cycle figures the costs are fitted from.

Timing noise (`Deployment.jitter`): every step's work × a gamma draw of mean
1 and that coefficient of variation, from a generator seeded by
`Deployment.seed`; without it the model is deterministic and groups of
sessions stay in lockstep.

Why simpy: the model is a handful of interacting queues whose batches form
from timing (who is queued when a server frees up), which closed forms do not
capture; simpy gives the event calendar and process coroutines, tested and
documented, so this module holds only the model.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass, field

import simpy

from .processor_sharing import Machine


@dataclass(frozen=True)
class StepCost:
    """Work of one step: fixed_s + per_session_s × sessions (seconds of one core or of its device)."""

    fixed_s: float = 0.0
    per_session_s: float = 0.0

    def __call__(self, sessions: int) -> float:
        return self.fixed_s + self.per_session_s * sessions


@dataclass(frozen=True)
class Costs:
    # fixed: per message in or out; per session: per session-cycle (spread over the cycle's passes)
    orchestrator: StepCost
    verifier: StepCost  # per verify forward
    drafter: StepCost | None = None  # None: no drafter service (speculation off, ngram drafted in the orchestrator)
    client_per_cycle_s: float = 0.0  # the load generator's CPU per session-cycle (0: not modelled)

    def slowed(self, factor: float) -> Costs:
        """Every process's work × factor: the machine's processes running slower
        beside other processes' load (benchmarks/capacity_fit.py)."""

        def f(c: StepCost) -> StepCost:
            return StepCost(c.fixed_s * factor, c.per_session_s * factor)

        return Costs(
            f(self.orchestrator),
            f(self.verifier),
            f(self.drafter) if self.drafter is not None else None,
            self.client_per_cycle_s * factor,
        )


@dataclass(frozen=True)
class Deployment:
    orchestrators: int = 1
    verifiers: int = 1
    drafters: int = 1
    cores: float = 2  # the head machine's cores: the orchestrators always run there
    services_on_head: bool = True  # True: the services share those cores (one CPU box); False: a device each
    client_on_head: bool = True  # the load generator's CPU is spent there too
    max_batch: int = 32  # sessions per service step (what the services were given as max_batch_sessions)
    wait_fraction: float = 0.5  # the services' gather window, a fraction of the last step's run time
    split: tuple[int, ...] = ()  # streams per orchestrator (empty: as even as possible)
    # "batched": one message per replica per step carries every session ready;
    # "per_session": a message per session's call and answer, which the
    # orchestrator handles one at a time (so its sessions reach a service one by one).
    transport: str = "batched"
    # Timing noise: every step's work is drawn from a gamma distribution of
    # mean 1 and this coefficient of variation (0: the fitted cost exactly),
    # from a generator seeded with `seed`, so a run is reproducible.
    jitter: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class Workload:
    streams: int
    cycles_per_request: float  # mean; request lengths alternate floor / ceil to match it
    tokens_per_cycle: float
    requests: int | None = None  # a finite run (the benchmark's): this many requests, then stop; None: steady state


@dataclass
class SimResult:
    seconds: float
    session_cycles: int
    session_cycles_per_s: float
    tokens_per_s: float
    busy: dict[str, list[float]]  # per kind of process, each one's busy share of its core (or device)
    machine_busy: float  # the head machine: cores in use / cores
    mean_batch: dict[str, float]  # sessions per step, verifier and drafter
    bottleneck: str


@dataclass(eq=False)
class Session:
    index: int
    orchestrator: Orchestrator
    verifier: Service
    drafter: Service | None
    cycles_left: int = 0
    opens_left: int = 0  # OpenSession answers the session still waits for

    def services(self) -> list[Service]:
        return [self.verifier] + ([self.drafter] if self.drafter is not None else [])


class Server:
    """One process: waits for work, then runs steps (subclasses' `step`)."""

    def __init__(self, sim: Simulation, machine: Machine):
        self.sim, self.env, self.machine = sim, sim.env, machine
        self.inbox: list = []
        self._signal = self.env.event()
        self.cpu_s = 0.0  # work of the steps done
        self._running: tuple[simpy.Event, float] | None = None  # the step in progress and its work
        self.steps = 0
        self.sessions = 0  # sessions over all steps
        self.env.process(self._loop())

    def put(self, item) -> None:
        self.inbox.append(item)
        if not self._signal.triggered:
            self._signal.succeed()

    def _loop(self):
        while True:
            if not self.inbox:
                self._signal = self.env.event()
                yield self._signal
            yield from self.step()

    def work(self, seconds: float):
        if seconds <= 0:
            # No work (a cost not modelled): done at once, before any other
            # process sees the moment (a free orchestrator sends a burst of new
            # requests' opens together).
            return
        seconds *= self.sim.noise()
        done = self.machine.run(seconds)
        self._running = (done, seconds)
        yield done
        self._running = None
        self.cpu_s += seconds

    def consumed(self) -> float:
        """Work done so far, the step in progress's part included (its
        machine advanced to now): a window counts what ran inside it."""
        if self._running is None:
            return self.cpu_s
        done, seconds = self._running
        return self.cpu_s + seconds - max(0.0, done.job[0])  # type: ignore[attr-defined]

    def step(self):
        raise NotImplementedError


class Service(Server):
    """A verifier or drafter replica; inbox: sessions with a call queued."""

    def __init__(self, sim: Simulation, machine: Machine, cost: StepCost, kind: str):
        super().__init__(sim, machine)
        self.cost, self.kind = cost, kind
        self.active = 0  # sessions on this replica in a request: the calls the gather window waits for
        self._last_run_s = 0.0

    def step(self):
        dep = self.sim.deployment
        if dep.wait_fraction > 0 and dep.max_batch > 1:
            # The gather window (specd_core/runtime/batcher.py `_gather`): wait while
            # fewer sessions are queued than are open here and calling (a new
            # session's open is queued but not yet one of them), at most
            # wait_fraction of the last forward's run time.
            deadline = self.env.now + dep.wait_fraction * self._last_run_s
            while len(self.inbox) < min(dep.max_batch, self.active) and self.env.now < deadline:
                self._signal = self.env.event()
                yield self._signal | self.env.timeout(deadline - self.env.now)
        batch, self.inbox = self.inbox[: dep.max_batch], self.inbox[dep.max_batch :]
        start = self.env.now
        yield from self.work(self.cost(len(batch)))
        self._last_run_s = self.env.now - start
        calls = [s for s, kind in batch if kind == "call"]
        opens = [s for s, kind in batch if kind == "open"]
        if calls:  # as the services' batch-size histograms count: forwards with calls, and their calls
            self.steps += 1
            self.sessions += len(calls)
        for s in opens:  # admitted: one of the sessions the gather window waits for from now on
            self.active += 1
            s.orchestrator.put(("opened", [s], 1))  # a unary OpenSession: its own answer
        if self.sim.deployment.transport == "per_session":
            # A message per session; the fixed cost rides on the first answer
            # each orchestrator gets from the step (below).
            first: set[Orchestrator] = set()
            for s in calls:
                s.orchestrator.put((self.kind, [s], 2 if s.orchestrator not in first else 0))
                first.add(s.orchestrator)
            return
        replies: dict[Orchestrator, list[Session]] = defaultdict(list)
        for s in calls:
            replies[s.orchestrator].append(s)
        for orch, sessions in replies.items():  # one message per orchestrator
            orch.put((self.kind, sessions, 1))


@dataclass
class Handled:
    """What the orchestrator's step made of its messages (Orchestrator.handle)."""

    out: dict[Service, list[Session]] = field(default_factory=lambda: defaultdict(list))
    opens: list[Session] = field(default_factory=list)
    emitted: list[Session] = field(default_factory=list)
    handled: int = 0
    charged: int = 0  # messages at the fixed cost


UNARY = ("start", "opened")  # messages of one session each, handled one at a time


class Orchestrator(Server):
    """Inbox: messages (kind, sessions, weight); kind "start" (a new request),
    "drafter" (proposals) or "verifier" (verdicts); weight: how many times the
    fixed cost the message carries.

    The fixed cost is per message in and out with batched messages: a service
    step's answer and the message it sends on, two per service step, which is
    how the fit counts them (benchmarks/capacity_fit.py). With a message per
    session it cannot be told apart per message; it is then charged twice per
    service step's burst of answers (on the first), the same count, as the
    cost of waking up to a burst. A new request carries none (the fit counts
    none: its cost is spread over the request's cycles)."""

    def __init__(self, sim: Simulation, machine: Machine, cost: StepCost, passes: int):
        super().__init__(sim, machine)
        self.cost, self.passes = cost, passes
        self.messages = 0

    @staticmethod
    def handle(messages: list) -> Handled:
        """What a step's messages make: each session's next call, the requests
        to open, the cycles ended, the session-messages handled and the
        messages charged at the fixed cost."""
        h = Handled()
        for kind, sessions, weight in messages:
            h.charged += weight
            for s in sessions:
                if kind == "start":
                    h.opens.append(s)
                    continue
                if kind == "opened":
                    s.opens_left -= 1
                    if s.opens_left > 0:
                        continue
                else:
                    h.handled += 1
                if kind == "verifier":
                    s.cycles_left -= 1
                    h.emitted.append(s)
                    if s.cycles_left == 0:
                        # Closed on every replica: a unary CloseSession each, its
                        # message out and its answer.
                        h.charged += 2 * len(s.services())
                        continue
                if kind != "drafter" and s.drafter is not None:
                    h.out[s.drafter].append(s)
                else:
                    h.out[s.verifier].append(s)
        return h

    def step(self):
        # A new request and a session's open are unary messages, each handled
        # on its own as it comes (so a burst of new requests reaches the
        # verifier one open at a time); the services' batched answers that
        # arrived meanwhile are handled together.
        first = self.inbox.pop(0)
        if first[0] in UNARY or self.sim.deployment.transport == "per_session":
            messages = [first]
        else:
            messages = [first] + [m for m in self.inbox if m[0] not in UNARY]
            self.inbox = [m for m in self.inbox if m[0] in UNARY]
        h = self.handle(messages)
        out, opens, emitted, handled, charged = h.out, h.opens, h.emitted, h.handled, h.charged
        # A unary OpenSession to each replica (its answer is charged as it comes in).
        charged += sum(len(s.services()) for s in opens)
        if self.sim.deployment.transport == "batched":
            charged += len(out)
        yield from self.work(self.cost.fixed_s * charged + self.cost.per_session_s / self.passes * handled)
        self.steps += 1
        self.sessions += handled
        self.messages += charged
        for s in opens:
            s.opens_left = len(s.services())
            s.verifier.put((s, "open"))  # the prefill joins the verifier's next forward
            if s.drafter is not None:
                # The drafter opens a session on its gRPC thread, not in a
                # forward: answered at once (its work is in the fitted costs).
                s.drafter.active += 1
                self.put(("opened", [s], 1))
        for service, sessions in out.items():
            for s in sessions:
                service.put((s, "call"))
        for s in emitted:
            if s.cycles_left == 0:
                self.sim.end_request(s)
        self.sim.cycles_done(emitted)


class Client(Server):
    """The load generator: reads every cycle's tokens; starts a stream's next
    request once it has read the last one. Inbox: (session, whether the
    cycle was its request's last) per cycle ended."""

    def __init__(self, sim: Simulation, machine: Machine, per_cycle_s: float):
        super().__init__(sim, machine)
        self.per_cycle_s = per_cycle_s

    def step(self):
        batch, self.inbox = self.inbox, []
        yield from self.work(self.per_cycle_s * len(batch))
        self.steps += 1
        self.sessions += len(batch)
        for s, last in batch:
            if last:
                self.sim.start_request(s)


def split_even(streams: int, parts: int) -> list[int]:
    return [streams // parts + (i < streams % parts) for i in range(parts)]


def request_cycles(k: int, mean: float) -> int:
    """The k-th request's cycles: floor / ceil of `mean` so that any run of
    requests averages it."""
    return max(1, math.floor((k + 1) * mean) - math.floor(k * mean))


class Simulation:
    def __init__(self, costs: Costs, deployment: Deployment, workload: Workload):
        self.costs, self.deployment, self.workload = costs, deployment, workload
        dep = deployment
        self.env = simpy.Environment()
        self.head = Machine(self.env, dep.cores)
        self._rng = random.Random(dep.seed)
        if dep.jitter < 0:
            raise ValueError(f"jitter {dep.jitter}: a coefficient of variation, not negative")

        def service_machine() -> Machine:
            return self.head if dep.services_on_head else Machine(self.env, 1)

        passes = 2 if costs.drafter is not None else 1
        self.orchestrators = [
            Orchestrator(self, self.head, costs.orchestrator, passes) for _ in range(dep.orchestrators)
        ]
        self.verifiers = [Service(self, service_machine(), costs.verifier, "verifier") for _ in range(dep.verifiers)]
        self.drafters = (
            [Service(self, service_machine(), costs.drafter, "drafter") for _ in range(dep.drafters)]
            if costs.drafter is not None
            else []
        )
        self.client = (
            Client(self, self.head if dep.client_on_head else Machine(self.env, 1), costs.client_per_cycle_s)
            if costs.client_per_cycle_s > 0
            else None
        )
        split = list(dep.split) or split_even(workload.streams, dep.orchestrators)
        if sum(split) != workload.streams or len(split) != dep.orchestrators:
            raise ValueError(f"split {split} is not {workload.streams} streams over {dep.orchestrators} orchestrators")
        if dep.transport not in ("batched", "per_session"):
            raise ValueError(f"transport {dep.transport!r}: batched or per_session")
        self.sessions: list[Session] = []
        for o, count in enumerate(split):
            for j in range(count):
                # Each orchestrator spreads its own sessions over the replicas
                # (least loaded as it sees them), starting at a different one.
                self.sessions.append(
                    Session(
                        len(self.sessions),
                        self.orchestrators[o],
                        self.verifiers[(j + o) % dep.verifiers],
                        self.drafters[(j + o) % dep.drafters] if self.drafters else None,
                    )
                )
        self.requests_started = 0
        self.cycles = 0
        self.last_cycle_at = 0.0
        self._marks: list[tuple[int, simpy.Event]] = []  # (cycles, event fired when they are reached)

    def noise(self) -> float:
        """A step's work relative to its fitted cost: 1, or with jitter a gamma
        draw of mean 1 and coefficient of variation `jitter`."""
        cv = self.deployment.jitter
        if cv <= 0:
            return 1.0
        return self._rng.gammavariate(1 / cv**2, cv**2)

    # The streams' closed loop.
    def start_request(self, s: Session) -> None:
        w = self.workload
        if w.requests is not None and self.requests_started >= w.requests:
            return
        k = self.requests_started
        self.requests_started += 1
        if w.requests is None and k < len(self.sessions):
            # Steady state: stagger the first requests' ends, as streams that
            # started at different times would have them.
            s.cycles_left = max(1, math.ceil(w.cycles_per_request * (k + 1) / len(self.sessions)))
        else:
            s.cycles_left = request_cycles(k, w.cycles_per_request)
        s.orchestrator.put(("start", [s], 0))

    def end_request(self, s: Session) -> None:
        for service in s.services():  # closed: no longer one the gather window waits for
            service.active -= 1
        if self.client is None:
            self.start_request(s)

    def cycles_done(self, sessions: list[Session]) -> None:
        if not sessions:
            return
        self.cycles += len(sessions)
        self.last_cycle_at = self.env.now
        if self.client is not None:
            for s in sessions:
                # Whether it was the request's last cycle, as of now: a client
                # that lags a cycle behind must not read the next request's count.
                self.client.put((s, s.cycles_left == 0))
        while self._marks and self._marks[0][0] <= self.cycles:
            self._marks.pop(0)[1].succeed()

    def at_cycles(self, n: int) -> simpy.Event:
        event = self.env.event()
        self._marks.append((n, event))
        self._marks.sort(key=lambda m: m[0])
        return event

    # Measurement.
    def snapshot(self) -> dict:
        for p in self._processes():
            p.machine.advance()
        return {
            "t": self.env.now,
            "cycles": self.cycles,
            "head_busy": self.head.busy_core_s,
            "procs": {id(p): (p.consumed(), p.steps, p.sessions) for p in self._processes()},
        }

    def _processes(self) -> list[Server]:
        return [*self.orchestrators, *self.verifiers, *self.drafters, *([self.client] if self.client else [])]

    def result(self, a: dict, b: dict) -> SimResult:
        seconds = b["t"] - a["t"]
        cycles = b["cycles"] - a["cycles"]

        def delta(p: Server, i: int) -> float:
            return b["procs"][id(p)][i] - a["procs"][id(p)][i]

        busy = {
            "orchestrator": [delta(p, 0) / seconds for p in self.orchestrators],
            "verifier": [delta(p, 0) / seconds for p in self.verifiers],
            "drafter": [delta(p, 0) / seconds for p in self.drafters],
            "client": [delta(self.client, 0) / seconds] if self.client else [],
        }
        mean_batch = {
            kind: sum(delta(p, 2) for p in ps) / max(1, sum(delta(p, 1) for p in ps))
            for kind, ps in (("verifier", self.verifiers), ("drafter", self.drafters))
            if ps
        }
        machine_busy = (b["head_busy"] - a["head_busy"]) / (self.head.cores * seconds)
        return SimResult(
            seconds=seconds,
            session_cycles=cycles,
            session_cycles_per_s=cycles / seconds,
            tokens_per_s=cycles / seconds * self.workload.tokens_per_cycle,
            busy=busy,
            machine_busy=machine_busy,
            mean_batch=mean_batch,
            bottleneck=bottleneck(busy, machine_busy),
        )


def bottleneck(busy: dict[str, list[float]], machine_busy: float) -> str:
    """The most used resource: a process's core (or device), or the head machine's cores."""
    shares = {kind: max(v) for kind, v in busy.items() if v}
    shares["head cores"] = machine_busy
    return max(shares, key=lambda k: shares[k])


@dataclass
class Horizon:
    """Steady state: measure `measure` session-cycles after `warmup` (defaults scale with the streams)."""

    warmup: int = 0
    measure: int = 0


def simulate(costs: Costs, deployment: Deployment, workload: Workload, horizon: Horizon | None = None) -> SimResult:
    """Run the model. A finite workload (requests set) runs to its last cycle
    and is measured from start to end, like the benchmark's windows; a steady
    state one is measured over `horizon` session-cycles after a warm-up."""
    sim = Simulation(costs, deployment, workload)
    for s in sim.sessions:
        sim.start_request(s)
    if workload.requests is not None:
        start = sim.snapshot()
        sim.env.run()
        # Stale wake-ups may have moved the clock past the last cycle.
        end = sim.snapshot() | {"t": sim.last_cycle_at}
        return sim.result(start, end)
    h = horizon or Horizon()
    warmup = h.warmup or max(500, 5 * workload.streams)
    measure = h.measure or max(2000, 10 * workload.streams)
    sim.env.run(until=sim.at_cycles(warmup))
    start = sim.snapshot()
    sim.env.run(until=sim.at_cycles(warmup + measure))
    return sim.result(start, sim.snapshot())

"""The capacity model's pure parts (benchmarks/capacity_sim.py,
benchmarks/capacity_fit.py): the fit recovers known costs, processor sharing
splits a machine's cores, and closed-loop cases whose throughput is known in
closed form come out of the simulation exactly."""

import math
from dataclasses import replace

import pytest
import simpy

from benchmarks.capacity_fit import Window, fit_costs, fit_slowdown, fit_step_cost
from benchmarks.capacity_sim import Costs, Deployment, Simulation, StepCost, Workload, request_cycles, simulate
from benchmarks.processor_sharing import Machine

pytestmark = pytest.mark.unit

# No request ends inside the measured window: the lockstep cases stay in lockstep.
ENDLESS = 1e9


def isolated(**kw) -> Deployment:
    """Each service on its own device, no load generator, no gather window."""
    return Deployment(**{"services_on_head": False, "client_on_head": False, "wait_fraction": 0.0, **kw})


def lockstep(**kw) -> Deployment:
    """As isolated, with a gather window that waits for every open session:
    groups that formed as the sessions opened merge at their first turn, and
    the steady state is one group."""
    return isolated(**{"wait_fraction": 2.0, **kw})


def test_fit_recovers_step_and_session_costs():
    fixed, per = 2e-3, 0.3e-3
    rows = [(1, 1.0), (8, 7.0), (32, 20.0), (64, 31.0)]  # streams, mean batch
    windows = [Window(4000, 4000 / batch, fixed * 4000 / batch + per * 4000) for _, batch in rows]
    fit = fit_step_cost(windows)
    assert fit.cost.fixed_s == pytest.approx(fixed, rel=1e-9)
    assert fit.cost.per_session_s == pytest.approx(per, rel=1e-9)
    assert fit.rms_rel < 1e-9


def test_fit_holds_a_negative_cost_at_zero_and_needs_two_batch_sizes():
    # CPU per session-cycle that grows with the batch would need a negative
    # fixed cost: it is held at 0 and the mean taken.
    fit = fit_step_cost([Window(100, 100, 0.1), Window(100, 10, 0.2)])
    assert fit.cost.fixed_s == 0 and fit.cost.per_session_s == pytest.approx(1.5e-3)
    one = fit_step_cost([Window(100, 50, 0.2), Window(200, 100, 0.4)])  # the same batch twice
    assert one.cost == StepCost(0.0, 2e-3)


def test_fit_costs_from_benchmark_rows():
    """Every process's costs from rows shaped as benchmarks/orchestrator.py writes them."""
    truth = {
        "orchestrator": StepCost(0.05e-3, 0.8e-3),
        "verifier": StepCost(1.0e-3, 0.7e-3),
        "drafter": StepCost(1.5e-3, 0.9e-3),
    }
    rows = []
    for batch in (1.0, 2.5, 6.0, 12.0):
        cycles = 1000
        v = d = cycles / batch
        cpu = {
            "orchestrator": [
                # Two messages per service step, four per request per service (open, close)
                truth["orchestrator"].fixed_s * (2 * (v + d) + 4 * 2 * 16)
                + truth["orchestrator"].per_session_s * cycles
            ],
            "verifier": [truth["verifier"](0) * v + truth["verifier"].per_session_s * cycles],
            "drafter": [truth["drafter"](0) * d + truth["drafter"].per_session_s * cycles],
            "client": 0.25e-3 * cycles,
        }
        run = {
            "cycles": cycles,
            "requests": 16,
            "wall_s": 5.0,
            "cpu_s": cpu["orchestrator"][0],
            "cpu": cpu,
            "steps": {"verifier": [v], "drafter": [d]},
        }
        rows.append({"runs": [run]})
    fitted = fit_costs(rows, with_drafter=True)
    for kind, cost in truth.items():
        got = getattr(fitted.costs, kind)
        assert got.fixed_s == pytest.approx(cost.fixed_s, rel=1e-6), kind
        assert got.per_session_s == pytest.approx(cost.per_session_s, rel=1e-6), kind
    assert fitted.costs.client_per_cycle_s == pytest.approx(0.25e-3)


def benchmark_rows(truth: dict[str, StepCost], others: list[float], slowdown: float) -> list[dict]:
    """Rows as benchmarks/orchestrator.py writes them (no drafter), each
    window's CPU slowed by 1 + slowdown × its other processes' load."""
    rows = []
    for batch, load in zip((1.0, 2.5, 6.0, 12.0, 1.0, 6.0), others):
        cycles, requests = 1000, 16
        v = cycles / batch
        f = 1 + slowdown * max(0.0, load)
        steps = {"orchestrator": 2 * v + 4 * requests, "verifier": v}
        cpu = {k: [f * (c.fixed_s * steps[k] + c.per_session_s * cycles)] for k, c in truth.items()}
        cpu["client"] = f * 0.2e-3 * cycles
        cpu["drafter"] = []
        run = {"cycles": cycles, "requests": requests, "wall_s": 1.0, "cpu_s": cpu["orchestrator"][0]}
        run |= {"cpu": cpu, "steps": {"verifier": [v], "drafter": []}, "others_cores": load}
        rows.append({"runs": [run]})
    return rows


def test_fit_slowdown_beside_other_load():
    """Windows measured beside other processes' load cost more CPU per
    session-cycle; the fit finds the slowdown and the quiet machine's costs,
    and finds none where the load made no difference. A negative load (the
    CPU accounting's rounding) counts as none."""
    truth = {"orchestrator": StepCost(0.3e-3, 0.2e-3), "verifier": StepCost(1.5e-3, 0.3e-3)}
    others = [0.0, 0.4, -0.02, 0.1, 0.3, 0.0]
    rows = benchmark_rows(truth, others, slowdown=0.5)
    slowdown = fit_slowdown({"off": (rows, False)})
    assert slowdown == pytest.approx(0.5)
    fitted = fit_costs(rows, with_drafter=False, slowdown=slowdown)
    for kind, cost in truth.items():
        assert getattr(fitted.costs, kind).fixed_s == pytest.approx(cost.fixed_s, rel=1e-6), kind
        assert getattr(fitted.costs, kind).per_session_s == pytest.approx(cost.per_session_s, rel=1e-6), kind
    # Without the slowdown the costs come out off and the residuals large.
    plain = fit_costs(rows, with_drafter=False)
    assert plain.fits["verifier"].rms_rel > 0.05
    assert fit_slowdown({"off": (benchmark_rows(truth, others, slowdown=0.0), False)}) == 0.0
    assert fit_slowdown({"off": (benchmark_rows(truth, [0.0] * 6, slowdown=0.0), False)}) == 0.0


def test_costs_slowed():
    costs = Costs(StepCost(1, 2), StepCost(3, 4), StepCost(5, 6), 7)
    assert costs.slowed(1.5) == Costs(StepCost(1.5, 3), StepCost(4.5, 6), StepCost(7.5, 9), 10.5)
    assert Costs(StepCost(1, 2), StepCost(3, 4)).slowed(2).drafter is None


@pytest.mark.parametrize("streams", [1, 8, 64])
def test_one_server_in_lockstep(streams):
    """One verifier with fixed a + b per session, S sessions always in one
    step, nothing else costing: S / (a + b S) session-cycles per second."""
    a, b = 10e-3, 1e-3
    costs = Costs(orchestrator=StepCost(), verifier=StepCost(a, b))
    res = simulate(costs, isolated(max_batch=1000), Workload(streams, ENDLESS, 1.0))
    assert res.session_cycles_per_s == pytest.approx(streams / (a + b * streams), rel=1e-6)
    assert res.mean_batch["verifier"] == pytest.approx(streams)
    assert res.bottleneck == "verifier"


def test_a_batch_cap_splits_the_sessions_into_steps():
    """64 sessions, at most 32 a step: two steps per cycle, 64 / 2(a + 32 b)."""
    a, b = 10e-3, 1e-3
    costs = Costs(orchestrator=StepCost(), verifier=StepCost(a, b))
    res = simulate(costs, isolated(max_batch=32), Workload(64, ENDLESS, 1.0))
    assert res.session_cycles_per_s == pytest.approx(64 / (2 * (a + 32 * b)), rel=1e-6)


def test_a_cycle_passes_orchestrator_drafter_orchestrator_verifier():
    """Batched messages, every process on its own core: one cycle of S
    sessions is two orchestrator steps (each 2 messages: in, out; half the
    per-session cost), a draft step and a verify step, one after the other."""
    o, v, d = StepCost(0.1e-3, 0.4e-3), StepCost(5e-3, 0.1e-3), StepCost(2e-3, 0.05e-3)
    s = 16
    costs = Costs(orchestrator=o, verifier=v, drafter=d)
    res = simulate(costs, lockstep(cores=4, max_batch=64), Workload(s, ENDLESS, 2.5))
    cycle = 2 * (2 * o.fixed_s + o.per_session_s / 2 * s) + v(s) + d(s)
    assert res.session_cycles_per_s == pytest.approx(s / cycle, rel=1e-6)
    assert res.tokens_per_s == pytest.approx(2.5 * s / cycle, rel=1e-6)
    assert res.busy["orchestrator"][0] == pytest.approx((4 * o.fixed_s + o.per_session_s * s) / cycle, rel=1e-6)


def finish_times(cores: float, works: dict[str, float]) -> tuple[dict[str, float], Machine]:
    """When each job, all started at t = 0 on one machine, is done."""
    env = simpy.Environment()
    machine = Machine(env, cores)
    done: dict[str, float] = {}
    for name, work in works.items():
        machine.run(work).callbacks.append(lambda _, name=name: done.__setitem__(name, env.now))
    env.run()
    return done, machine


def test_processor_sharing_halves_speed_on_one_core():
    assert finish_times(1, {"a": 1.0, "b": 1.0})[0] == {"a": pytest.approx(2.0), "b": pytest.approx(2.0)}
    assert finish_times(2, {"a": 1.0, "b": 1.0})[0] == {"a": pytest.approx(1.0), "b": pytest.approx(1.0)}
    # Never more than a core each: three jobs on two cores run at 2/3 speed.
    assert finish_times(2, {"a": 1.0, "b": 1.0, "c": 1.0})[0]["c"] == pytest.approx(1.5)


def test_processor_sharing_speeds_up_when_a_job_leaves():
    done, machine = finish_times(1, {"short": 1.0, "long": 3.0})
    # Together at half speed until the short one is done (t = 2), then the
    # long one alone: 2 units left at full speed.
    assert done == {"short": pytest.approx(2.0), "long": pytest.approx(4.0)}
    assert machine.busy_core_s == pytest.approx(4.0)


def test_two_busy_servers_on_one_core_halve_the_throughput():
    """Two verifiers, each with its own sessions and always busy (no other
    cost): two cores give each its own, one core halves both."""
    a, b = 10e-3, 1e-3
    costs = Costs(orchestrator=StepCost(), verifier=StepCost(a, b))
    rates = {}
    for cores in (1, 2):
        dep = Deployment(
            verifiers=2, cores=cores, services_on_head=True, client_on_head=False, wait_fraction=0.0, max_batch=100
        )
        rates[cores] = simulate(costs, dep, Workload(16, ENDLESS, 1.0)).session_cycles_per_s
    assert rates[2] == pytest.approx(2 * 8 / (a + b * 8), rel=1e-6)
    assert rates[1] == pytest.approx(rates[2] / 2, rel=1e-6)


def test_orchestrators_split_the_load_and_the_slowest_sets_the_pace():
    """Orchestrator-bound: N orchestrators on N cores carry N times one's
    session-cycles; an uneven split runs at the pace its busiest one allows
    (the services are free, so each orchestrator's sessions cycle alone)."""
    per = 1e-3
    costs = Costs(orchestrator=StepCost(0.0, per), verifier=StepCost())
    one = simulate(costs, isolated(orchestrators=1, cores=1, max_batch=1000), Workload(8, ENDLESS, 1.0))
    two = simulate(costs, isolated(orchestrators=2, cores=2, max_batch=1000), Workload(8, ENDLESS, 1.0))
    assert one.session_cycles_per_s == pytest.approx(1 / per, rel=1e-6)
    assert two.session_cycles_per_s == pytest.approx(2 / per, rel=1e-6)
    assert two.busy["orchestrator"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert two.bottleneck == "orchestrator"


def test_per_message_cost_grows_with_orchestrators():
    """A verify step answers each orchestrator with its own message: with a
    per-message cost, two orchestrators pay it twice per step where one pays
    it once (the same sessions, the same total per-session cost)."""
    costs = Costs(orchestrator=StepCost(1e-3, 0.0), verifier=StepCost(5e-3, 0.0))
    res1 = simulate(costs, lockstep(orchestrators=1, cores=8, max_batch=100), Workload(8, ENDLESS, 1.0))
    res2 = simulate(costs, lockstep(orchestrators=2, cores=8, max_batch=100), Workload(8, ENDLESS, 1.0))
    # One orchestrator: a step of 2 ms (message in + out) then the 5 ms verify.
    assert res1.session_cycles_per_s == pytest.approx(8 / 7e-3, rel=1e-6)
    # Two: each handles its own message in parallel (2 ms), then the verify.
    assert res2.session_cycles_per_s == pytest.approx(8 / 7e-3, rel=1e-6)
    total_cpu = [sum(r.busy["orchestrator"]) / r.session_cycles_per_s for r in (res1, res2)]
    assert total_cpu[1] == pytest.approx(2 * total_cpu[0], rel=1e-6)


def test_finite_run_counts_every_cycle_of_every_request():
    costs = Costs(orchestrator=StepCost(0.0, 0.5e-3), verifier=StepCost(1e-3, 0.2e-3), client_per_cycle_s=0.1e-3)
    res = simulate(costs, Deployment(cores=2), Workload(4, 10.5, 2.0, requests=8))
    assert res.session_cycles == 84  # 8 requests alternating 10 and 11 cycles
    assert res.session_cycles_per_s > 0 and res.busy["client"][0] > 0


def test_request_cycles_average_the_mean():
    assert [request_cycles(k, 2.5) for k in range(4)] == [2, 3, 2, 3]
    assert sum(request_cycles(k, 63.25) for k in range(400)) == math.floor(400 * 63.25)


def test_gather_window_merges_groups_only_when_it_outlasts_their_offset():
    """16 streams with a drafter open one after the other and split into
    groups that take turns at the verifier; requests ending bring new ones in
    at their own phase. The gather window waits for the other group at most
    wait_fraction of a verify forward (~6.6 ms here): half of it is shorter
    than the other group's turn at the drafter and the orchestrator, so the
    groups stay apart (about two of 8); a whole one outlasts it, and the
    forwards hold nearly all 16."""
    costs = Costs(orchestrator=StepCost(0.0, 0.2e-3), verifier=StepCost(5e-3, 0.1e-3), drafter=StepCost(2e-3, 0.05e-3))
    batch = {}
    for wait in (0.0, 0.5, 1.0):
        dep = isolated(cores=1, max_batch=64, wait_fraction=wait)
        batch[wait] = simulate(costs, dep, Workload(16, 20, 1.0)).mean_batch["verifier"]
    assert batch[0.0] < 9 and batch[0.5] < 9
    assert batch[1.0] > 14


def test_per_session_transport_handles_sessions_one_at_a_time():
    """A message per session: the orchestrator handles one at a time, and a
    free verifier answers each at once in a step of its own, so every pass
    pays the fixed cost twice (the answer, the message on): 1 / (2a + b)
    session-cycles per second, where batched messages share it: S / (2a + bS)."""
    a, b, s = 0.1e-3, 0.5e-3, 8
    costs = Costs(orchestrator=StepCost(a, b), verifier=StepCost())
    rates = {
        t: simulate(costs, isolated(cores=1, max_batch=100, transport=t), Workload(s, ENDLESS, 1.0))
        for t in ("per_session", "batched")
    }
    assert rates["per_session"].session_cycles_per_s == pytest.approx(1 / (2 * a + b), rel=1e-6)
    assert rates["per_session"].mean_batch["verifier"] == pytest.approx(1.0)
    # Batched, every pass's sessions in one message at best: S / (2a + bS).
    # The sessions open one after the other, so they may form a few groups
    # (a message each) and fall short of it, but above one at a time.
    batched = rates["batched"].session_cycles_per_s
    assert rates["per_session"].session_cycles_per_s * 1.2 < batched <= s / (2 * a + b * s) * (1 + 1e-9)


def test_a_request_opens_with_a_prefill_in_the_verifiers_forward():
    """One stream without a drafter: each request's open is a verifier forward
    of its own before its C cycles' verifies, so a request takes C + 1
    forwards; the batch-size count (as the services' histogram) counts only
    the C with calls."""
    a, b, c = 4e-3, 1e-3, 5
    costs = Costs(orchestrator=StepCost(), verifier=StepCost(a, b))
    res = simulate(costs, isolated(max_batch=32), Workload(1, c, 1.0, requests=6))
    assert res.session_cycles == 6 * c
    assert res.session_cycles_per_s == pytest.approx(c / ((c + 1) * (a + b)), rel=1e-6)
    assert res.mean_batch["verifier"] == pytest.approx(1.0)


@pytest.mark.parametrize("wait", [0.0, 0.5])
def test_sessions_opened_out_of_phase_take_turns(wait):
    """Two streams with a drafter. Opened one after the other (the orchestrator
    handles each new request on its own, at a cost), the second session's
    prefill waits behind the first's, so it reaches the drafter a forward later:
    the two take turns at verifier and drafter, a session per forward, and the
    gather window (half a forward) does not merge them. Opened at the same
    moment (a free orchestrator), they share every forward."""
    t = 5e-3
    service = StepCost(t, 0.0)
    batch = {}
    for per_message in (0.0, 0.01e-3):
        costs = Costs(orchestrator=StepCost(per_message, 0.0), verifier=service, drafter=service)
        res = simulate(costs, isolated(cores=1, max_batch=32, wait_fraction=wait), Workload(2, ENDLESS, 1.0))
        batch[per_message] = res.mean_batch
    assert batch[0.0] == {"verifier": pytest.approx(2.0), "drafter": pytest.approx(2.0)}
    assert batch[0.01e-3] == {"verifier": pytest.approx(1.0), "drafter": pytest.approx(1.0)}


def test_gather_window_waits_only_for_admitted_sessions():
    """A queued open is not one of the sessions the window waits for (the
    verifier admits it in the forward): a lone stream's forwards never wait,
    its requests run as fast as without a window."""
    costs = Costs(orchestrator=StepCost(0.05e-3, 0.1e-3), verifier=StepCost(4e-3, 1e-3))
    rates = [
        simulate(costs, isolated(max_batch=32, wait_fraction=w), Workload(1, 4, 1.0, requests=5)).session_cycles_per_s
        for w in (0.0, 0.5)
    ]
    assert rates[1] == pytest.approx(rates[0], rel=1e-9)


def test_jitter_draws_have_mean_one_and_the_given_variation():
    """Every step's work × a gamma draw of mean 1 and coefficient of variation
    `jitter`, from the deployment's seed: the same seed, the same draws."""
    costs = Costs(orchestrator=StepCost(), verifier=StepCost(1e-3, 0))
    for cv in (0.25, 1.0):
        sim = Simulation(costs, isolated(jitter=cv, seed=3), Workload(1, ENDLESS, 1.0))
        draws = [sim.noise() for _ in range(40000)]
        mean = sum(draws) / len(draws)
        sd = math.sqrt(sum((d - mean) ** 2 for d in draws) / len(draws))
        assert mean == pytest.approx(1.0, abs=0.02)
        assert sd / mean == pytest.approx(cv, rel=0.05)
        again = Simulation(costs, isolated(jitter=cv, seed=3), Workload(1, ENDLESS, 1.0))
        assert [again.noise() for _ in range(5)] == draws[:5]
    assert Simulation(costs, isolated(), Workload(1, ENDLESS, 1.0)).noise() == 1.0
    with pytest.raises(ValueError):
        Simulation(costs, isolated(jitter=-0.1), Workload(1, ENDLESS, 1.0))


def test_jitter_keeps_a_serial_loop_s_mean_and_splits_lockstep_groups():
    """One stream: its steps run one after another, so noise of mean 1 leaves
    the rate as it was (within the noise of a few thousand draws), also with
    the load generator lagging behind at times (it must start each request
    once, or the gather window waits for a session that never calls). Two
    orchestrators' groups with no gather window: the deterministic model
    keeps them in step, each orchestrator's answer reaching the verifier at
    the same moment; with noisy step times one is back first and the
    verifier starts without the other, so its batches shrink."""
    costs = Costs(StepCost(0.3e-3, 0.2e-3), StepCost(1.5e-3, 0.3e-3), client_per_cycle_s=0.2e-3)
    dep = Deployment(orchestrators=1, cores=2, max_batch=32, wait_fraction=0.5)
    work = Workload(1, 63, 1.0, requests=64)
    exact = simulate(costs, dep, work).session_cycles_per_s
    for cv in (0.5, 1.0, 1.5):
        noisy = [simulate(costs, replace(dep, jitter=cv, seed=s), work).session_cycles_per_s for s in range(3)]
        assert sum(noisy) / 3 == pytest.approx(exact, rel=0.03), cv
    costs = Costs(orchestrator=StepCost(0.0, 0.1e-3), verifier=StepCost(2e-3, 0.1e-3))
    lock = simulate(costs, isolated(orchestrators=2, max_batch=100), Workload(16, ENDLESS, 1.0))
    assert lock.mean_batch["verifier"] == pytest.approx(16)
    noisy = simulate(costs, isolated(orchestrators=2, max_batch=100, jitter=1.0), Workload(16, ENDLESS, 1.0))
    assert noisy.mean_batch["verifier"] < 12

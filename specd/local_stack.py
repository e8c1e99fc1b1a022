"""The three services as local processes on real ports (no Ray): used by the
real-process tests and by the benchmarks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from orchestrator.pair import check_pair
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import open_channel
from specd_core.net.security import TlsConfig
from specd_core.runtime.head_formats import PUBLISHED, head_format

ROOT = Path(__file__).resolve().parents[1]


def popen(argv: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    """Start a service process: its output (stdout and stderr) on one text pipe."""
    return subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


# How ServiceProcess starts a process. The test suite replaces it with one that
# forks the process from a parent that has already imported torch (tests/zygote.py);
# anything else starts a fresh interpreter.
launch: Callable[[list[str], dict, Path], Any] = popen


class ServiceProcess:
    """`python -m MODULE ARGS --port PORT` (0: any free port), waiting for its
    'listening on H:P' line.

    env: extra environment variables (e.g. OTEL_*). A 'metrics on H:P' line
    (printed before it with --metrics-port) sets `metrics_address`; an
    orchestrator's 'http on URL' line sets `http_url`. An orchestrator serves
    no HTTP API unless --http-port is given: several run at once here, and
    its default port would be taken by the first."""

    def __init__(self, module: str, *args: str, timeout_s: float = 120.0, env: dict | None = None, port: int = 0):
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        if module == "orchestrator" and "--http-port" not in args:
            args = (*args, "--http-port", "0")
        self.proc = launch([sys.executable, "-m", module, *args, "--port", str(port)], env, ROOT)
        self.lines: list[str] = []
        self.metrics_address: str | None = None
        self.http_url: str | None = None  # scheme://127.0.0.1:port of an orchestrator's HTTP API
        out = self.proc.stdout
        assert out is not None  # stdout=PIPE
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = out.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"{module} exited early:\n" + "".join(self.lines))
            self.lines.append(line)
            m = re.search(r"metrics on (\S*):(\d+)", line)
            if m:
                self.metrics_address = f"127.0.0.1:{m.group(2)}"
            m = re.search(r"http on (https?)://\S*:(\d+)", line)
            if m:
                self.http_url = f"{m.group(1)}://127.0.0.1:{m.group(2)}"
            m = re.search(r"listening on (\S+):(\d+)", line)
            if m:
                self.address = f"127.0.0.1:{m.group(2)}"
                break
        else:
            self.stop()
            raise TimeoutError(f"{module} did not start:\n" + "".join(self.lines))
        # Drain output in the background so the pipe never fills up.
        threading.Thread(target=self._drain, args=(out,), daemon=True).start()

    def _drain(self, out: IO[str]) -> None:
        for line in out:
            self.lines.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _start_all(starts: list[tuple[str, ...]], env: dict | None) -> list[ServiceProcess]:
    """A process per command, started in parallel; on a failure the others are stopped, then it raises."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(ServiceProcess, *cmd, env=env) for cmd in starts]
    procs = []
    for f in futures:  # all waited for
        try:
            procs.append(f.result())
        except Exception:
            for p in (g.result() for g in futures if g.exception() is None):
                p.stop()
            raise
    return procs


@dataclass(frozen=True)
class StackOptions:
    """How a Stack runs, besides its pair and the flags of both model services
    (what Stack's docstring says of each)."""

    env: dict | None = None
    metrics: bool = False
    verifier_args: tuple[str, ...] = ()
    verifiers: int = 1
    drafters: int = 1
    orchestrator_args: tuple[str, ...] = ()
    client_tls: TlsConfig | None = None
    http: bool = False
    orchestrators: int = 1


class Stack:
    """Verifier + drafter + orchestrator processes for one model pair.

    env: extra environment variables for all three (e.g. OTEL_EXPORTER_OTLP_ENDPOINT);
    metrics: serve Prometheus /metrics on free ports (each process's `metrics_address`);
    verifier_args: flags for the verifier only (e.g. --max-batch-sessions 1);
    verifiers / drafters: replicas of each, one process each (`verifiers`,
    `drafters`; `verifier` and `drafter_proc` are the first), started in parallel;
    orchestrator_args: flags for the orchestrators only (e.g. --auth-tokens-file F);
    client_tls: how `channel` reaches the orchestrator (None: plaintext);
    http: serve the OpenAI-compatible HTTP API on a free port (`http_url`,
    `openai_base_url`); off by default;
    orchestrators: processes serving Generate (and the HTTP API) on ONE port
    (SO_REUSEPORT, --share-ports: the kernel gives each new connection to one
    of them), all on the same replicas: the first picks a free port, the others
    are given it. `orchestrators` lists them, `orchestrator` is the first.
    `channel` is one connection, so it reaches one of them; `connect()` opens a
    channel with a connection of its own. Off Ray each reports and admits on
    its own (Status lists only itself; --max-active-requests is per process)."""

    def __init__(self, target: str, drafter: str | None, service_args: tuple[str, ...] = (), **options):
        """options: StackOptions' fields, by name."""
        opts = StackOptions(**options)
        self.target, self.drafter = target, drafter
        # A pair that cannot draft together is refused before any process starts.
        check_pair(target, drafter)
        extra = ("--metrics-port", "0") if opts.metrics else ()
        starts = [("verifier_svc", "--model", target, *service_args, *opts.verifier_args, *extra)] * opts.verifiers
        # A published head names no target: it is told where its target is.
        head = ("--target-dir", target) if head_format(drafter) in PUBLISHED else ()
        starts += [("drafter_svc", "--model", drafter, *head, *service_args, *extra)] * (
            opts.drafters if drafter else 0
        )
        procs = _start_all(starts, opts.env)
        self.verifiers, self.drafters = procs[: opts.verifiers], procs[opts.verifiers :]
        self.verifier = self.verifiers[0]
        self.drafter_proc = self.drafters[0] if self.drafters else None
        args = ["--target", target, *extra, *opts.orchestrator_args, "--http-port", "-1" if opts.http else "0"]
        for v in self.verifiers:
            args += ["--verifier-address", v.address]
        if drafter:
            args += ["--drafter", drafter]
            for d in self.drafters:
                args += ["--drafter-address", d.address]
        try:
            self.orchestrators = self._start_orchestrators(args, opts.orchestrators, opts.env)
        except Exception:
            for p in (*self.drafters, *self.verifiers):
                p.stop()
            raise
        self.orchestrator = self.orchestrators[0]
        self.http_url = self.orchestrator.http_url  # None unless http
        self.http_address = self.http_url.split("://")[1] if self.http_url else None  # 127.0.0.1:port
        self.client_tls = opts.client_tls
        self.channel = open_channel(self.orchestrator.address, opts.client_tls)
        self.stub = pb_grpc.OrchestratorServiceStub(self.channel)

    @staticmethod
    def _start_orchestrators(args: list[str], n: int, env: dict | None) -> list[ServiceProcess]:
        """One orchestrator, or n on one port: the first claims free ports, then
        the others join them (in parallel)."""
        if n == 1:
            return [ServiceProcess("orchestrator", *args, env=env)]
        first = ServiceProcess("orchestrator", *args, "--share-ports", "first", env=env)
        port = int(first.address.rsplit(":", 1)[1])
        http_port = first.http_url.rsplit(":", 1)[1] if first.http_url else "0"
        joining = [*args, "--share-ports", "join", "--http-port", http_port]
        with ThreadPoolExecutor(n - 1) as pool:
            futures = [pool.submit(ServiceProcess, "orchestrator", *joining, env=env, port=port) for _ in range(n - 1)]
        started = [first] + [f.result() for f in futures if f.exception() is None]
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            for p in started:
                p.stop()
            raise errors[0]
        return started

    def connect(self):
        """A channel to the shared address over a TCP connection of its own:
        the kernel hands it to one of the orchestrators (the caller closes it)."""
        return open_channel(self.orchestrator.address, self.client_tls, own_connection=True)

    @property
    def openai_base_url(self) -> str:
        """The base URL an OpenAI client takes (http=True)."""
        assert self.http_url, "this Stack serves no HTTP API (Stack(..., http=True))"
        return self.http_url + "/v1"

    def generate(self, metadata=None, **fields) -> tuple[list[int], pb.GenerateResponse | None]:
        """Run one Generate; return (all token ids, the final response; None if none came)."""
        ids: list[int] = []
        last = None
        for r in self.stub.Generate(pb.GenerateRequest(**fields), timeout=120, metadata=metadata):
            ids += r.token_ids
            last = r
        return ids, last

    def stop(self) -> None:
        self.channel.close()
        with ThreadPoolExecutor(len(self.orchestrators)) as pool:  # each waits for its streams to drain
            list(pool.map(ServiceProcess.stop, self.orchestrators))
        # The replicas once no orchestrator calls them, all at once: each one's
        # graceful shutdown is a wait, and waits taken in turn add up.
        replicas = [*self.drafters, *self.verifiers]
        with ThreadPoolExecutor(max(1, len(replicas))) as pool:
            list(pool.map(ServiceProcess.stop, replicas))

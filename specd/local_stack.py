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
from pathlib import Path

import grpc

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]


class ServiceProcess:
    """`python -m MODULE ARGS --port 0`, waiting for its 'listening on H:P' line.

    env: extra environment variables (e.g. OTEL_*). A 'metrics on H:P' line
    (printed before it with --metrics-port) sets `metrics_address`."""

    def __init__(self, module: str, *args: str, timeout_s: float = 120.0, env: dict | None = None):
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args, "--port", "0"], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.metrics_address: str | None = None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"{module} exited early:\n" + "".join(self.lines))
            self.lines.append(line)
            m = re.search(r"metrics on (\S*):(\d+)", line)
            if m:
                self.metrics_address = f"127.0.0.1:{m.group(2)}"
            m = re.search(r"listening on (\S+):(\d+)", line)
            if m:
                self.address = f"127.0.0.1:{m.group(2)}"
                break
        else:
            self.stop()
            raise TimeoutError(f"{module} did not start:\n" + "".join(self.lines))
        # Drain output in the background so the pipe never fills up.
        threading.Thread(target=lambda: [self.lines.append(l) for l in self.proc.stdout], daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Stack:
    """Verifier + drafter + orchestrator processes for one model pair.

    env: extra environment variables for all three (e.g. OTEL_EXPORTER_OTLP_ENDPOINT);
    metrics: serve Prometheus /metrics on free ports (each process's `metrics_address`);
    verifier_args: flags for the verifier only (e.g. --max-batch-sessions 1);
    orchestrator_args: flags for the orchestrator only (e.g. --method eagle)."""

    def __init__(self, target: str, drafter: str | None, service_args: tuple[str, ...] = (),
                 env: dict | None = None, metrics: bool = False, verifier_args: tuple[str, ...] = (),
                 orchestrator_args: tuple[str, ...] = ()):
        self.target, self.drafter = target, drafter
        extra = ("--metrics-port", "0") if metrics else ()
        self.verifier = ServiceProcess("verifier_svc", "--model", target, *service_args, *verifier_args, *extra,
                                       env=env)
        self.drafter_proc = ServiceProcess("drafter_svc", "--model", drafter, *service_args, *extra,
                                           env=env) if drafter else None
        args = ["--target", target, "--verifier-address", self.verifier.address, *extra, *orchestrator_args]
        if drafter:
            args += ["--drafter", drafter, "--drafter-address", self.drafter_proc.address]
        self.orchestrator = ServiceProcess("orchestrator", *args, env=env)
        self.channel = grpc.insecure_channel(self.orchestrator.address)
        self.stub = pb_grpc.OrchestratorServiceStub(self.channel)

    def generate(self, metadata=None, **fields) -> tuple[list[int], pb.GenerateResponse]:
        """Run one Generate; return (all token ids, the final response)."""
        ids, last = [], None
        for r in self.stub.Generate(pb.GenerateRequest(**fields), timeout=120, metadata=metadata):
            ids += r.token_ids
            last = r
        return ids, last

    def stop(self) -> None:
        self.channel.close()
        for p in (self.orchestrator, self.drafter_proc, self.verifier):
            if p:
                p.stop()

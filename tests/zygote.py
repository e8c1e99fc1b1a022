"""Service processes forked from a process that has already imported torch
and transformers, instead of each importing them anew.

Every service process the tests start (`specd.local_stack.ServiceProcess`:
verifier, drafter, orchestrator) spends about 3 s of CPU importing torch and
transformers before it reads its first flag; the suite starts a few hundred of
them, so on two cores that was minutes of its wall time. A zygote (one per
test process, started on first use) imports them once, then forks a child per
service. The child runs the service's own `__main__` with its own arguments,
environment, working directory and stdout/stderr pipe, exactly as `python -m
MODULE ARGS` would from that point: the real server on a real port, its own
signal handlers, its own exit code. Only the imports are shared.

Forking after `import torch` is safe because the zygote never runs a torch
operation (no thread pool exists yet) and never imports gRPC (whose core does
not survive a fork); each child imports gRPC for itself.

The test process is not the child's parent, so `ForkedProcess` stands in for
`subprocess.Popen` (pid, poll, wait, send_signal, kill, terminate, stdout):
the zygote reaps its children and writes each exit code to a file named by
the child's pid.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

PRELOAD = ("torch", "transformers", "numpy", "safetensors.torch", "tokenizers")
# What a service imports on its way to serving, beyond PRELOAD: Hugging
# Face's model-loading stack (`transformers` imports it lazily, on the first
# model loaded: about 2.5 s of CPU in every replica) and the HTTP front's
# FastAPI. None of them imports gRPC or starts a thread. The modeling modules
# are those of the families the tests build (tests/tiny_models.py); one a
# transformers release lacks is skipped here, and a service needing it fails
# on its own import as it would outside the zygote.
PRELOAD_LATER = (
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.activations",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.phi3.modeling_phi3",
    "transformers.models.gemma2.modeling_gemma2",
    "transformers.models.gemma3.modeling_gemma3",
    "fastapi",
)
MAX_MESSAGE = 1 << 20


def startup_env(env) -> dict:
    """The variables read while an interpreter starts or torch is imported.
    PYTHONUNBUFFERED is not among them: a child's output is unbuffered anyway."""
    prefixes = ("PYTHON", "OMP_", "MKL_", "TORCH_", "KMP_")
    return {k: v for k, v in env.items() if k.startswith(prefixes) and k != "PYTHONUNBUFFERED"}


class ForkedProcess:
    """What the tests use of a `subprocess.Popen`, for a zygote's child."""

    def __init__(self, pid: int, rc_file: Path, stdout: io.TextIOBase, args: list[str]):
        self.pid, self.rc_file, self.stdout, self.args = pid, rc_file, stdout, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.rc_file.exists():
            self.returncode = int(self.rc_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited; its code is on its way
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A zygote process, started on the first `launch`; `close` stops it (its
    children are on their own: their owners stop them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.startup: dict = {}
        self.dir = Path(tempfile.mkdtemp(prefix="specd-zygote-"))
        self.sock = str(self.dir / "sock")

    def _start(self) -> None:
        self.startup = startup_env(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.sock, str(self.dir)],
            cwd=Path(__file__).resolve().parents[1],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the test zygote did not start: {line!r}")

    def launch(self, argv: list[str], env: dict, cwd: Path) -> ForkedProcess:
        """Like Popen(argv, env=env, cwd=cwd, stdout=PIPE, stderr=STDOUT,
        text=True) for argv = [python, "-m", MODULE, ARGS...]."""
        assert argv[1] == "-m", argv
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
        if startup_env(env) != self.startup:
            # What the interpreter reads as it starts (an import path, a
            # sitecustomize, torch's thread count) differs from the zygote's.
            # (Imported here: the zygote itself must not import gRPC.)
            from specd.local_stack import popen

            return popen(argv, env, cwd)
        read, write = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(self.sock)
                request = json.dumps({"module": argv[2], "args": argv[3:], "env": env, "cwd": str(cwd)})
                socket.send_fds(s, [request.encode()], [write])
                pid = int(s.recv(64))
        finally:
            os.close(write)
        return ForkedProcess(pid, self.dir / str(pid), io.TextIOWrapper(os.fdopen(read, "rb")), argv)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------ the zygote


def _run_child(request: dict, out_fd: int) -> None:
    """In the forked child: become `python -m MODULE ARGS` and exit as it would."""
    code = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # As a fresh interpreter starts: SIGPIPE ignored, so that a write to a
        # socket whose client has gone raises an error the server handles
        # (with the default action the server process would die of it).
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", 0), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", 0), write_through=True, line_buffering=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]
        sys.argv = [request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        # What the interpreter does at exit: wait for non-daemon threads, run atexit.
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _serve(sock_path: str, rc_dir: Path) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_LATER:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    parent = os.getppid()

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            tmp = rc_dir / f"{pid}.tmp"
            tmp.write_text(str(os.waitstatus_to_exitcode(status)))
            tmp.rename(rc_dir / str(pid))

    signal.signal(signal.SIGCHLD, reap)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(sock_path)
    server.listen(64)
    server.settimeout(1.0)
    print("ready", flush=True)
    while os.getppid() == parent:  # the test process is gone: so is the zygote
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        msg, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
        request = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            _run_child(request, fds[0])
        os.close(fds[0])
        conn.sendall(str(pid).encode())
        conn.close()


if __name__ == "__main__":
    _serve(sys.argv[1], Path(sys.argv[2]))

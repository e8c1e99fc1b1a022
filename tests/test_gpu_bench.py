"""benchmarks/gpu.py in its tiny CPU mode: every step it runs on a GPU runs
here too (pair building, in-process forward timing, streams through the
services, a sampled stream), so the script cannot rot between GPU runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_tiny_mode(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--tiny", "--rounds", "1", "--seconds", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    # Every (sessions, rows) cell timed, with a positive time.
    cells = {(r["sessions"], r["rows"]) for r in report["verify_ms"]}
    assert cells == {(1, 1), (1, 5), (4, 1), (4, 5)}
    assert all(r["ms"] > 0 and r["ms_graphs"] > 0 for r in report["verify_ms"] + report["draft_ms"])
    assert all(len(r["graphs_over_eager"]["rounds"]) == 3 for r in report["verify_ms"])
    assert [r["streams"] for r in report["streams"]] == [1, 2]
    for r in report["streams"]:  # both stacks served every setting
        assert all(r[f"{s}_tokens_per_s"] > 0 for s in ("eager_off", "eager_k4", "off", "k4", "default"))
        assert r["k4_vs_eager_k4"] > 0 and r["default_vs_off"] > 0
    # The forced acceptance holds: K = 4 chains are kept whole (4 drafts + a
    # bonus per cycle, less where max_new_tokens cuts the last cycle short).
    assert report["cycle"]["tokens_per_cycle"] >= 3.5
    assert report["cycle"]["sampled_tokens"] == 12
    assert report["meta"]["engines"] == {"target": "lean", "drafter": "lean"}  # Llama-3 RoPE runs lean
    # Whole steps through the cores: one host sync per verify step and one
    # per draft level, whatever the number of sessions; the profiler names
    # the attention that ran; both attention settings timed.
    assert [r["sessions"] for r in report["steps"]] == [1, 4]
    for r in report["steps"]:
        assert r["verify_chain"]["syncs"] == 1 and r["verify_tree"]["syncs"] == 1
        # A CPU decides sampled chains in Python on the host's copy (a few reads
        # of it, whatever the sessions); on CUDA the batched form reads once.
        assert r["verify_chain_sampled"]["syncs"] == report["steps"][0]["verify_chain_sampled"]["syncs"] <= 4
        assert r["draft_chain"]["syncs"] == 4
        assert "aten::scaled_dot_product_attention" in r["verify_chain"]["profile"]["attention"]
        assert "aten::scaled_dot_product_attention" in r["verify_chain"]["profile_graphs"]["attention"]
        for kind in ("verify", "verify_mixed", "draft"):
            times = r["attention_settings"][kind]
            for name in ("eager", "no_cudnn", "key_bucket_64", "fold_heads", "graphs"):
                assert times[name] > 0
            for name in ("no_cudnn", "key_bucket_64", "fold_heads", "graphs"):
                assert len(times[f"{name}_over_eager"]["rounds"]) == 3
    assert "forced" in report["meta"]["acceptance"]

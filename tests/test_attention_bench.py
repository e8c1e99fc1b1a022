"""benchmarks/attention.py: its attention calls - the engine's gather (query
heads folded on a CPU), the same with the grouped-query call, one call per
session in place, flex_attention over the paged pool - compute the same
step, decode rows and chains alike, so that its timings compare like with
like."""

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
    # The demo target (as many KV heads as query heads), then a grouped-query
    # model (Llama-3's layout: query heads share KV heads).
    gqa = tmp_path / "gqa"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(gqa)
    for model, shape, layers in ((DEMO_TARGET, ("3", "5", "70"), 8), (gqa, ("2", "1", "130"), 2)):
        out = tmp_path / "attention.json"
        assert attention.main(["--model", str(model), "--reps", "1", "--out", str(out), "--shape", *shape]) == 0
        (r,) = json.loads(out.read_text())["steps"]
        assert (r["sessions"], r["rows"], r["context"]) == tuple(int(x) for x in shape)
        assert r["layers"] == layers
        for name in ("gather", "grouped", "in_place", "flex"):
            assert r[f"{name}_ms"] > 0
            assert r[f"{name}_max_diff"] < 1e-4, (model, name, r)

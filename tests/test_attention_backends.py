"""SPECD_ATTENTION_BACKENDS: the SDPA implementations the lean engine's calls
may use. The setting is parsed with errors that name the value, the engine
runs its calls with the named implementation only (seen in the profiler),
the outputs do not change, and a service refuses a bad value at start."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend

from specd_core.runtime import attention_backends
from specd_core.runtime.attention_backends import ENV, FOLD_ENV, KEY_BUCKET_ENV, parse_backends
from specd_core.runtime.models import Runner, load_model
from specd_core.runtime.step_graphs import ENV as GRAPHS_ENV

ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = ROOT / "models" / "demo" / "target"


@pytest.mark.unit
def test_the_setting_is_parsed_in_its_order_and_a_bad_name_is_named():
    assert parse_backends(None) is None
    assert parse_backends("") is None
    assert parse_backends(" Auto ") is None
    assert parse_backends("efficient, flash,math") == [
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.MATH,
    ]
    assert parse_backends("cudnn") == [SDPBackend.CUDNN_ATTENTION]
    for bad in ("flash,fast", ",", "sdpa"):
        with pytest.raises(ValueError) as err:
            parse_backends(bad)
        assert ENV in str(err.value) and repr(bad) in str(err.value)
        assert "flash, efficient, cudnn, math" in str(err.value)


def _attention_ops(lean, tokens):
    session = lean.new_session()
    with torch.profiler.profile() as prof:
        logits = lean.forward_batch([(session, tokens, None, None)])[0]
    return logits, {e.name for e in prof.events() if "scaled_dot_product" in e.name}


@pytest.mark.unit
def test_the_engine_runs_its_calls_with_the_named_implementation(monkeypatch):
    monkeypatch.setenv(ENV, "math")
    lean = Runner(load_model(str(DEMO_TARGET), "cpu", "float32")).lean
    assert lean.attention_backends == [SDPBackend.MATH]
    tokens = list(range(5, 40))
    restricted, ops = _attention_ops(lean, tokens)
    assert "aten::_scaled_dot_product_attention_math" in ops
    assert not any("flash" in op for op in ops), ops
    lean.attention_backends = None  # torch's choice: its fused CPU kernel
    free, ops = _attention_ops(lean, tokens)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert torch.allclose(restricted, free, atol=1e-4), (restricted - free).abs().max()
    # A context with no backend named leaves torch's choice alone.
    with attention_backends.restricted(None):
        assert torch.equal(_attention_ops(lean, tokens)[0], free)


@pytest.mark.unit
def test_a_setting_that_cannot_run_on_the_device_stops_the_load(monkeypatch):
    # cuDNN's implementation exists on CUDA only: alone, no call could run on a CPU.
    monkeypatch.setenv(ENV, "cudnn")
    with pytest.raises(ValueError) as err:
        Runner(load_model(str(DEMO_TARGET), "cpu", "float32"))
    assert f"{ENV}='cudnn': none of cudnn runs this model's attention on cpu" in str(err.value)
    monkeypatch.setenv(ENV, "cudnn,math")  # with one that runs there, it loads
    assert Runner(load_model(str(DEMO_TARGET), "cpu", "float32")).lean is not None


@pytest.mark.services
@pytest.mark.parametrize(
    "name, value, message",
    [
        (ENV, "flash,fast", "SPECD_ATTENTION_BACKENDS='flash,fast': unknown attention backend(s) ['fast']"),
        (KEY_BUCKET_ENV, "64k", "SPECD_KEY_BUCKET='64k': want a whole number of key rows"),
        (GRAPHS_ENV, "yes", "SPECD_CUDA_GRAPHS='yes': want one of auto, on, off"),
        (FOLD_ENV, "maybe", "SPECD_FOLD_HEADS='maybe': want one of auto, on, off"),
    ],
)
def test_a_service_refuses_a_bad_setting_at_start(name, value, message):
    proc = subprocess.run(
        [sys.executable, "-m", "verifier_svc", "--model", str(DEMO_TARGET), "--port", "0", "--device", "cpu"],
        cwd=ROOT, env={**os.environ, name: value}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert f"verifier_svc: {message}" in proc.stderr

"""The KV budget on a real verifier process (gRPC, no orchestrator).

* Sessions that together need more blocks than the budget: the one that does
  not fit is refused (RESOURCE_EXHAUSTED naming the budget) - at open, or at a
  Verify that would grow its cache - while the others go on; the refused
  session goes on too once blocks come back, and the service never fails.
* Resident memory: a verifier whose sessions fill a 64 MiB budget grows by the
  budget and no more, and the session past it is refused. Baseline: the same process after one session of the
  same size was opened and closed (weights, Python/torch runtime, and the
  allocator warmed by a prefill of that size); allowance over the budget:
  ALLOWANCE_MIB (a forward's activations, allocator rounding; measured here:
  0-1 MiB). Short prompts keep a prefill's activations small: with 1000-token
  prompts its attention scores (~30 MiB, 8 heads) are freed but may stay
  resident in the allocator, which is activation memory, not the KV cache."""
from __future__ import annotations

import grpc
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specd.local_stack import ServiceProcess
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.kv_budget import kv_row_bytes
from tests.test_memory import rss_kib

pytestmark = pytest.mark.services

GREEDY = pb.SamplingParams(temperature=0.0)
ALLOWANCE_MIB = 8


def _open(stub, sid, prompt):
    return stub.OpenSession(pb.OpenVerifySessionRequest(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY),
                            timeout=60)


def _refused(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.value.code(), e.value.details())
    return e.value.details()


def _info(stub):
    return stub.Info(pb.ReplicaInfoRequest(), timeout=10)


def test_budget_refuses_what_does_not_fit_and_others_go_on(pairs):
    target, _ = pairs["llama"]
    from specd_core.runtime.models import Runner, load_model
    row = Runner(load_model(target, "cpu")).kv_row_bytes
    # Prefix caching off: these sessions' equal prompts would share blocks
    # (tests/test_prefix_cache_services.py covers that), and this counts them.
    proc = ServiceProcess("verifier_svc", "--model", target, "--kv-block-size", "16",
                          "--kv-cache-memory", f"{8 * 16 * row}B", "--no-prefix-caching")  # 8 blocks of 16 tokens
    try:
        with grpc.insecure_channel(proc.address) as ch:
            stub = pb_grpc.VerifierServiceStub(ch)
            info = _info(stub)
            assert (info.kv_capacity_tokens, info.kv_block_tokens, info.kv_used_tokens) == (128, 16, 0)
            assert info.engine == "lean" and info.architecture == "LlamaForCausalLM" and info.dtype == "float32"
            assert info.cuda_graphs == "off"  # auto: off on a CPU
            _open(stub, "a", list(range(40, 80)))   # 40 rows: 3 blocks
            _open(stub, "b", list(range(40, 80)))   # 3 blocks
            msg = _refused(lambda: _open(stub, "c", list(range(40, 80))))
            assert "verifier KV budget full" in msg and "session 'c'" in msg and "--kv-cache-memory" in msg
            assert _info(stub).kv_used_tokens == 96 and _info(stub).sessions == 2
            _open(stub, "d", list(range(40, 60)))   # the last 2 blocks
            assert _info(stub).kv_used_tokens == 128
            # "a" verifies within its 48 rows until a draft needs one more block: refused, alone.
            for _ in range(2):
                stub.Verify(pb.VerifyRequest(session_id="a", draft_token_ids=[9]), timeout=30)
            msg = _refused(lambda: stub.Verify(pb.VerifyRequest(session_id="a", draft_token_ids=[9] * 6),
                                               timeout=30))
            assert "session 'a'" in msg and "KV budget full" in msg
            r = stub.Verify(pb.VerifyRequest(session_id="b", draft_token_ids=[9, 9]), timeout=30)
            assert len(r.token_ids) >= 1    # another session goes on
            # Blocks come back on close; the refused verify then runs.
            stub.CloseSession(pb.CloseSessionRequest(session_id="b"), timeout=10)
            assert _info(stub).kv_used_tokens == 80
            r = stub.Verify(pb.VerifyRequest(session_id="a", draft_token_ids=[9] * 6), timeout=30)
            assert len(r.token_ids) >= 1
            for sid in ("a", "d"):
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
            assert _info(stub).kv_used_tokens == 0
        assert proc.proc.poll() is None
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A random Llama whose KV rows are big (16 KiB per token), so that a few
    long sessions fill a budget far above the process's noise."""
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=64, vocab_size=256, max_position_embeddings=2048,
                      eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("wide")
    LlamaForCausalLM(cfg).save_pretrained(out)
    return str(out), kv_row_bytes(4, 8, 64, torch.float32)


def test_resident_memory_stays_within_the_budget(wide_model):
    model_dir, row = wide_model
    assert row == 16384
    # 230-token prompts: 4 blocks of 64 rows (4 MiB) each, two verifies of 8
    # included; short enough that a prefill's activations (its attention
    # scores: 8 heads x 230^2 floats) stay small beside the budget.
    budget_mib, prompt = 64, [1 + i % 200 for i in range(230)]
    proc = ServiceProcess("verifier_svc", "--model", model_dir, "--kv-cache-memory", f"{budget_mib}MiB",
                          "--max-draft-tokens", "8", "--no-prefix-caching")  # equal prompts: see above
    try:
        with grpc.insecure_channel(proc.address) as ch:
            stub = pb_grpc.VerifierServiceStub(ch)
            assert _info(stub).kv_capacity_bytes == budget_mib * 2**20
            # Warm-up: one session of the size used below, verified and closed.
            _open(stub, "warm", prompt)
            stub.Verify(pb.VerifyRequest(session_id="warm", draft_token_ids=[3] * 8), timeout=60)
            stub.CloseSession(pb.CloseSessionRequest(session_id="warm"), timeout=10)
            base = rss_kib(proc.proc.pid)
            sids = []
            while True:     # fill the budget; the first session that does not fit is refused
                sid = f"s{len(sids)}"
                try:
                    _open(stub, sid, prompt)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV budget full" in e.details()
                    break
                sids.append(sid)
                for _ in range(2):
                    stub.Verify(pb.VerifyRequest(session_id=sid, draft_token_ids=[3] * 8), timeout=60)
                assert len(sids) <= 16
            info = _info(stub)
            full = rss_kib(proc.proc.pid)
            grown_mib = (full - base) / 1024
            print(f"verifier RSS: {base / 1024:.0f} MiB warm and empty, {full / 1024:.0f} MiB with "
                  f"{len(sids)} sessions holding {info.kv_used_bytes / 2**20:.0f} of {budget_mib} MiB")
            assert len(sids) == 16 and info.kv_used_bytes == budget_mib * 2**20
            # The cache is really resident (zeroed pages), and nothing beyond it is.
            assert 0.75 * budget_mib <= grown_mib <= budget_mib + ALLOWANCE_MIB, grown_mib
            for sid in sids:
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
            assert _info(stub).kv_used_bytes == 0
    finally:
        proc.stop()

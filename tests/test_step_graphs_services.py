"""Greedy output through the real services with CUDA graphs' padded steps
(SPECD_CUDA_GRAPHS=on; on a CPU the padded static buffers without capture,
specd_core/runtime/step_graphs.py) equals target-only greedy output."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from specd.cli import main
from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_model, load_tokenizer
from specd_core.runtime.step_graphs import ENV
from tests.test_family_services import MAX_NEW, _prompts
from tests.test_greedy_exact import assert_same_or_near_tie, reference
from tests.tiny_models import build_model, build_perturbed_drafter, build_tokenizer

pytestmark = pytest.mark.services


def test_greedy_through_services_with_padded_steps_equals_target_only(tmp_path, capsys):
    """The real services with SPECD_CUDA_GRAPHS=on (on a CPU: every decode,
    verify and draft step through the padded static buffers), three streams
    at once so that steps hold 1-3 sessions padded to 1, 2 or 4: greedy output
    equals target-only greedy for chains and a tree, on Gemma-2 (sliding
    windows the prompts pass, soft-capping)."""
    tok = build_tokenizer(tmp_path / "tok")
    target = build_model(tmp_path / "target", "gemma2", "target", 1, tok, 15.0)
    drafter = build_perturbed_drafter(target, tmp_path / "drafter", noise=0.3)
    model, prompts = load_model(target, "cpu"), _prompts(load_tokenizer(target))
    stack = Stack(target, drafter, env={ENV: "on"})
    try:
        for proc in (stack.verifier, stack.drafter_proc):  # both replicas run their steps padded
            assert any("CUDA graphs (SPECD_CUDA_GRAPHS=on): padded static steps" in line for line in proc.lines)
        status = pb_grpc.AdminServiceStub(stack.channel).Status(pb.StatusRequest(), timeout=30)
        assert {(r.kind, r.cuda_graphs) for r in status.replicas} == {
            ("verifier", "on: padded static steps, no capture on cpu"),
            ("drafter", "on: padded static steps, no capture on cpu"),
        }
        assert main(["status", "--address", stack.orchestrator.address]) == 0
        assert "verifier-0 CUDA graphs on: padded static steps, no capture on cpu\n" in capsys.readouterr().out
        for draft in ({"num_speculative_tokens": 3}, {"tree": {"branching": [2, 2, 1]}}):
            with ThreadPoolExecutor(len(prompts)) as pool:
                runs = list(
                    pool.map(
                        lambda p: stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW, **draft), prompts
                    )
                )
            for n, (p, (got, last)) in enumerate(zip(prompts, runs)):
                want, gaps = reference(model, p)
                assert_same_or_near_tie(got, want[:MAX_NEW], gaps[:MAX_NEW], f"prompt {n} {draft}")
                assert last.stats.accepted_tokens > 0
    finally:
        stack.stop()

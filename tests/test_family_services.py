"""The model families through the real services (tiny random-initialised
checkpoints with each family's real config fields, tests/tiny_models.py,
saved and loaded like a user's): greedy output equals target-only
greedy for chains and a tree, with both replicas on the lean engine; and on
Gemma-2 - soft-capping, sandwich norms, sliding windows, outside Llama/Qwen2 -
speculative sampling follows the target's exact law (the exact-law test of
tests/test_sampling_lossless.py)."""

import pytest

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_greedy_exact import assert_same_or_near_tie, reference
from tests.test_sampling_lossless import N, check_stream_law, exact_joint, null_threshold, tv
from tests.tiny_models import build_model, build_perturbed_drafter, build_tokenizer, corpus_lines

pytestmark = pytest.mark.services

MAX_NEW = 24
# Through the services, one model per structure the engine distinguishes:
# Llama and Qwen2 run through tests/test_greedy_exact.py already, and the
# other RoPE variants of Llama (linear, dynamic, yarn), Phi-3 (Phi-3.5's
# structure with default RoPE) and Mistral differ from these only inside the forward,
# which tests/test_families.py checks for every family against Hugging Face.
# Mistral's one quirk, a sliding window, is crossed here by Gemma-2 and Gemma-3.
# Gemma-2 last: its stack then also serves the sampling test (family_stacks).
SERVED = ("llama3", "qwen3", "phi3.5", "gemma3", "gemma2")


@pytest.fixture(scope="module")
def family_pairs(tmp_path_factory):
    """family -> (target_dir, drafter_dir): the drafter is the target plus
    noise, so drafts are sometimes kept and sometimes not."""
    root = tmp_path_factory.mktemp("families")
    tok = build_tokenizer(root / "tokenizer")
    out = {}
    for family in SERVED:
        target = build_model(root / f"{family}-target", family, "target", 1, tok, 15.0)
        out[family] = (target, build_perturbed_drafter(target, root / f"{family}-drafter", noise=0.3))
    return out


@pytest.fixture(scope="module")
def family_stacks(family_pairs):
    """family -> a running Stack, one at a time (starting another stops the
    last): Gemma-2 is served last in SERVED, so its stack serves both its greedy
    and its sampling test (default flags for both; the law test's requests
    are seeded, the greedy test's stats are per request, so neither sees the
    other)."""
    running: dict = {}

    def get(family):
        if family not in running:
            for other in running.values():
                other.stop()
            running.clear()
            running[family] = Stack(*family_pairs[family])
        return running[family]

    yield get
    for stack in running.values():
        stack.stop()


def _prompts(tok, n=3):
    lines = [line for line in corpus_lines() if len(line.strip()) > 30]
    # Long enough that prompt + output pass the tiny models' sliding windows.
    return [tok("\n".join(lines[40 * i: 40 * i + 3]))["input_ids"][:40] for i in range(n)]


@pytest.mark.parametrize("family", SERVED)
def test_greedy_through_the_services_equals_target_only(family, family_pairs, family_stacks):
    target, _ = family_pairs[family]
    model, tok = load_model(target, "cpu"), load_tokenizer(target)
    stack = family_stacks(family)
    status = pb_grpc.AdminServiceStub(stack.channel).Status(pb.StatusRequest(), timeout=30)
    assert sorted((r.kind, r.engine) for r in status.replicas) == [("drafter", "lean"), ("verifier", "lean")]
    accepted = 0
    for n, p in enumerate(_prompts(tok)):
        want, gaps = reference(model, p)
        want, gaps = want[:MAX_NEW], gaps[:MAX_NEW]
        for draft in ({"num_speculative_tokens": 3}, {"tree": {"branching": [2, 2, 1]}}):
            got, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW, **draft)
            assert_same_or_near_tie(got, want, gaps, f"{family} prompt {n} {draft}")
            accepted += last.stats.accepted_tokens
    assert accepted > 0  # drafts were really kept


@pytest.mark.statistical
def test_sampling_is_lossless_on_gemma2(family_pairs, family_stacks):
    target, drafter = family_pairs["gemma2"]
    prompt = [40, 41, 42, 43, 44]
    params = SamplingParams(1.0, 1.0, 6)
    joint = exact_joint(target, prompt, params)
    threshold = null_threshold(joint, N)
    drafter_joint = exact_joint(drafter, prompt, params)
    assert tv(joint, {k: v * N for k, v in drafter_joint.items()}, N) > 2 * threshold  # the test has power
    check_stream_law(family_stacks("gemma2"), prompt, joint, threshold,
                     {"temperature": 1.0, "top_p": 1.0, "top_k": 6, "num_speculative_tokens": 2})


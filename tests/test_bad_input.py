"""Bad input gets INVALID_ARGUMENT with a message saying what is
wrong, and the services keep serving other sessions."""
import math

import grpc
import pytest

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

pytestmark = pytest.mark.services

PROMPT = {"ids": [40, 41, 42]}

BAD_GENERATE = [
    ("empty prompt", dict(prompt=""), "prompt must not be empty"),
    ("empty token prompt", dict(prompt_token_ids={"ids": []}), "prompt must not be empty"),
    ("no prompt", dict(), "either prompt"),
    ("chat without a template", dict(messages=[{"role": "user", "content": "hi"}]),
     "the target tokenizer has no chat template; send prompt or prompt_token_ids"),
    ("prompt over context", dict(prompt_token_ids={"ids": [5] * 300}), "context is 256"),
    ("max_new_tokens 0", dict(prompt_token_ids=PROMPT, max_new_tokens=0), "max_new_tokens"),
    ("max_new_tokens < 0", dict(prompt_token_ids=PROMPT, max_new_tokens=-3), "max_new_tokens"),
    ("max_new_tokens over limit", dict(prompt_token_ids=PROMPT, max_new_tokens=10**6), "max_new_tokens"),
    ("temperature < 0", dict(prompt_token_ids=PROMPT, temperature=-0.5), "temperature"),
    ("temperature NaN", dict(prompt_token_ids=PROMPT, temperature=math.nan), "temperature"),
    ("temperature tiny", dict(prompt_token_ids=PROMPT, temperature=1e-30), "temperature must be 0"),
    ("top_p 0", dict(prompt_token_ids=PROMPT, top_p=0.0), "top_p"),
    ("top_p > 1", dict(prompt_token_ids=PROMPT, top_p=1.5), "top_p"),
    ("top_k < 0", dict(prompt_token_ids=PROMPT, top_k=-1), "top_k"),
    ("token id past vocab", dict(prompt_token_ids={"ids": [1, 384]}), "outside the vocabulary"),
    ("negative token id", dict(prompt_token_ids={"ids": [-1, 2]}), "outside the vocabulary"),
    ("K < 0", dict(prompt_token_ids=PROMPT, num_speculative_tokens=-1), "num_speculative_tokens"),
    ("K over limit", dict(prompt_token_ids=PROMPT, num_speculative_tokens=99), "num_speculative_tokens"),
    ("empty stop string", dict(prompt_token_ids=PROMPT, stop=[""]), "stop"),
    ("tree branching 0", dict(prompt_token_ids=PROMPT, tree={"branching": [2, 0]}), "branching"),
    ("tree too big", dict(prompt_token_ids=PROMPT, tree={"branching": [8, 8, 8]}), "over the limit of 64"),
    ("tree too deep", dict(prompt_token_ids=PROMPT, tree={"node_budget": 10, "max_depth": 40}), "max_depth"),
    ("empty tree", dict(prompt_token_ids=PROMPT, tree={}), "branching"),
    ("tree path before its parent", dict(prompt_token_ids=PROMPT, tree={"paths": [{"ranks": [0, 0]}]}),
     "before its parent"),
    ("tree paths and branching", dict(prompt_token_ids=PROMPT, tree={"branching": [2], "paths": [{"ranks": [0]}]}),
     "not both"),
    ("tree of 100k paths", dict(prompt_token_ids=PROMPT, tree={"paths": [{"ranks": [0]}] * 100_000}),
     "over the limit of 64"),
    # A resumed stream (resume_token_ids) with ids it cannot have received.
    ("resume id past vocab", dict(prompt_token_ids=PROMPT, max_new_tokens=8, resume_token_ids=[50, 384]),
     "resume_token_ids holds 1 id(s) outside the vocabulary [0, 384): [384]"),
    ("resume id negative", dict(prompt_token_ids=PROMPT, max_new_tokens=8, resume_token_ids=[-7]),
     "resume_token_ids holds 1 id(s) outside the vocabulary [0, 384): [-7]"),
    ("resume EOS", dict(prompt_token_ids=PROMPT, max_new_tokens=8, resume_token_ids=[50, 0, 51]),
     "resume_token_ids[1] is 0, an end-of-sequence id"),
    ("resume over max_new_tokens", dict(prompt_token_ids=PROMPT, max_new_tokens=4, resume_token_ids=[50] * 5),
     "resume_token_ids has 5 tokens, more than max_new_tokens 4"),
    ("resume over context", dict(prompt_token_ids={"ids": [5] * 200}, max_new_tokens=100, resume_token_ids=[50] * 60),
     "the prompt (200 tokens) and resume_token_ids (60) hold 260 tokens; the model's context is 256"),
    ("resume breaks the constraint", dict(prompt_token_ids=PROMPT, max_new_tokens=8, resume_token_ids=[50, 51],
                                          structured_output={"regex": "[0-9]+"}),
     "resume_token_ids break the output constraint"),
]


@pytest.mark.parametrize("name,fields,needle", BAD_GENERATE, ids=[b[0] for b in BAD_GENERATE])
def test_generate_rejects(name, fields, needle, stacks):
    stack = stacks["llama"]
    with pytest.raises(grpc.RpcError) as info:
        stack.generate(**fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()
    # ... and the service still serves a good request.
    ids, last = stack.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
    assert len(ids) == 4 and last.finish_reason == "length"


def _internal(stacks):
    s = stacks["llama"]
    v = pb_grpc.VerifierServiceStub(grpc.insecure_channel(s.verifier.address))
    d = pb_grpc.DrafterServiceStub(grpc.insecure_channel(s.drafter_proc.address))
    return v, d


def _code(call, request):
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    return info.value.code(), info.value.details()


def test_internal_services_reject_bad_calls(stacks):
    v, d = _internal(stacks)
    code, msg = _code(v.Verify, pb.VerifyRequest(session_id="nope", draft_token_ids=[1]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown session id 'nope'" in msg
    code, msg = _code(d.Propose, pb.ProposeRequest(session_id="nope", num_draft_tokens=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown session id" in msg
    code, msg = _code(v.CloseSession, pb.CloseSessionRequest(session_id="nope"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    sp = pb.SamplingParams(temperature=0.0)
    v.OpenSession(pb.OpenVerifySessionRequest(session_id="s1", prompt_token_ids=[1, 2], sampling=sp))
    d.OpenSession(pb.OpenDraftSessionRequest(session_id="s1", prompt_token_ids=[1, 2], sampling=sp))
    try:
        code, msg = _code(v.Verify, pb.VerifyRequest(session_id="s1", draft_token_ids=[1] * 17))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit of 16" in msg
        code, msg = _code(d.Propose, pb.ProposeRequest(session_id="s1", num_draft_tokens=0))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_draft_tokens" in msg
        code, msg = _code(d.Propose, pb.ProposeRequest(session_id="s1", num_draft_tokens=99))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the limit of 16" in msg
        code, msg = _code(v.Verify, pb.VerifyRequest(session_id="s1", draft_token_ids=[1, 999]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in msg
        code, msg = _code(v.Verify, pb.VerifyRequest(
            session_id="s1", draft_token_ids=[1],
            draft_distributions=[pb.SparseDistribution(token_ids=[1, 2], probs=[0.9]), pb.SparseDistribution()]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "draft distribution 0" in msg
        code, msg = _code(v.Verify, pb.VerifyRequest(
            session_id="s1", draft_token_ids=[1],
            draft_distributions=[pb.SparseDistribution(token_ids=[2], probs=[1.0]), pb.SparseDistribution()]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "probability 0 to drafted token" in msg
        # Malformed trees.
        for tokens, parents, needle in [([1, 2], [-1], "parents"), ([1, 2], [1, -1], "parent"),
                                        ([1, 1], [-1, -1], "both children"), ([1, 2], [-1, 5], "parent")]:
            code, msg = _code(v.Verify, pb.VerifyRequest(session_id="s1", draft_token_ids=tokens,
                                                         draft_parents=parents))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in msg, msg
        code, msg = _code(v.OpenSession, pb.OpenVerifySessionRequest(session_id="s1", prompt_token_ids=[1]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "already open" in msg
        # The session survived every bad call: a valid verify still works.
        r = v.Verify(pb.VerifyRequest(session_id="s1", draft_token_ids=[3]), timeout=30)
        assert len(r.token_ids) == r.num_accepted + 1
    finally:
        v.CloseSession(pb.CloseSessionRequest(session_id="s1"))
        d.CloseSession(pb.CloseSessionRequest(session_id="s1"))


def test_health_and_reflection(stacks):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    s = stacks["llama"]
    for proc in (s.verifier, s.drafter_proc, s.orchestrator):
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(proc.address))
        assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING

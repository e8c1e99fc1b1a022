"""The service cores in-process (no grpc): cache bookkeeping across cycles."""
import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd.errors import CapacityExceeded
from specd.sampling import SamplingParams
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def cores(pairs):
    target, drafter = pairs["llama"]
    return Verifier(VerifierConfig(target, device="cpu")), Drafter(DrafterConfig(drafter, device="cpu"))


@torch.inference_mode()
def greedy_chain(model, ids, k):
    out = []
    for _ in range(k):
        nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        out.append(nxt)
    return out


def test_caches_track_committed_tokens_across_cycles(cores):
    verifier, drafter = cores
    prompt = [40, 41, 42, 43]
    first = verifier.open_session("a", prompt, GREEDY)
    drafter.open_session("a", prompt, GREEDY)
    tokens, unsent, kept = prompt + [first], [first], 0
    kept_counts = []
    for cycle in range(12):
        k = 1 + cycle % 4
        proposal = drafter.propose("a", kept, unsent, k)
        # The drafter's cache, rolled back and extended many times, still drafts
        # exactly what its model drafts from scratch on the committed tokens.
        assert proposal.token_ids == greedy_chain(drafter.model, tokens, k)
        result = verifier.verify("a", proposal.token_ids)
        tokens += result.tokens
        unsent, kept = result.tokens, result.num_accepted
        kept_counts.append(kept)
        # Verifier invariant: the cache holds every committed token but the pending one.
        assert verifier._sessions["a"].cache.length == len(tokens) - 1
    assert 0 < sum(kept_counts) < sum(1 + c % 4 for c in range(12))   # some kept, some not
    verifier.close_session("a")
    drafter.close_session("a")
    assert verifier.num_sessions == 0 and verifier.kv_tokens == 0 and drafter.num_sessions == 0


def test_verifier_refuses_sessions_past_its_budget(pairs):
    target, _ = pairs["llama"]
    v = Verifier(VerifierConfig(target, device="cpu", max_sessions=2, max_kv_tokens=50))
    v.open_session("a", [1, 2, 3], GREEDY)
    with pytest.raises(CapacityExceeded, match="KV budget"):
        v.open_session("b", [1] * 60, GREEDY)
    v.open_session("c", [1, 2], GREEDY)
    with pytest.raises(CapacityExceeded, match="limit of 2 sessions"):
        v.open_session("d", [1, 2], GREEDY)
    # Running sessions are unharmed.
    assert len(v.verify("a", [5, 6]).tokens) >= 1

"""Method eagle: the head's lean forward against its reference torch
module, the verifier's features against Hugging Face's hidden states, and
through the real services greedy exactness (chains, static and dynamic trees)
and lossless sampling (statistical, tests/test_sampling_lossless.py's method).

The head is tiny and trained here for a few seconds on the tiny target's
features (tests/tiny_models.py corpus), so drafts are often but not always
kept: both the accepted-path and the rejection paths really run.
"""
from pathlib import Path

import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.eagle import EagleDrafter
from specd.local_stack import Stack
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams, logits_to_probs
from specd_core.runtime.eagle_head import EagleHead, HeadConfig, TargetParts, load_head, save_head
from specd_core.runtime.features import HiddenStates
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_greedy_exact import MAX_NEW, assert_same_or_near_tie, prompts, reference
from tests.test_sampling_lossless import N, check_stream_law, exact_joint, null_threshold, tv
from tests.tiny_models import corpus_lines
from training.eagle import head_loss, target_features
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier


def train_tiny_head(target_dir: str, out: Path, steps: int = 150) -> str:
    """A head for the tiny target, trained briefly on its own features."""
    torch.manual_seed(0)
    target = load_model(target_dir, "cpu")
    tok = load_tokenizer(target_dir)
    ids = torch.tensor(tok("\n".join(corpus_lines()))["input_ids"])
    head = EagleHead(HeadConfig.from_target(target.config))
    parts = TargetParts.of(target)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=g)
        x = torch.stack([ids[s:s + 64] for s in starts])
        with torch.no_grad():
            feats = target_features(target, x)
        loss, _ = head_loss(head, parts, x, feats, 1.0, 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_head(head, out, {"target": str(Path(target_dir).resolve())})
    return str(out)


@pytest.fixture(scope="module")
def eagle_pair(pairs, model_root):
    target_dir, _ = pairs["llama"]
    return target_dir, train_tiny_head(target_dir, model_root / "llama-eagle")


@pytest.fixture(scope="module")
def eagle_stack(eagle_pair):
    target_dir, head_dir = eagle_pair
    stack = Stack(target_dir, head_dir, orchestrator_args=("--method", "eagle"))
    yield stack
    stack.stop()


def reference_draft(head: EagleHead, parts: TargetParts, prompt_feats, tokens, k: int) -> list[int]:
    """Greedy chain of k from the reference module: pairs (x_{i+1}, f_i) over
    the known features, then its own predicted features (EAGLE)."""
    emb = [parts.embed[t] for t in tokens[1:len(prompt_feats) + 1]]
    feats = list(prompt_feats)
    out = []
    for _ in range(k):
        pred = head(torch.stack(emb)[None], torch.stack(feats)[None])[0, -1]
        tok = int(parts.logits(pred).argmax())
        out.append(tok)
        emb.append(parts.embed[tok])
        feats.append(pred)
    return out


@pytest.mark.unit
@torch.inference_mode()
def test_head_lean_forward_equals_reference(eagle_pair):
    """The drafter's lean head (fc -> lean layer -> target norm / LM head, its
    own predicted features fed back) drafts what the torch module computes."""
    target_dir, head_dir = eagle_pair
    target = load_model(target_dir, "cpu")
    head, parts = load_head(head_dir), TargetParts.of(target)
    d = EagleDrafter(DrafterConfig(head_dir, device="cpu"))
    prompt = [40, 41, 42, 43, 44, 45, 46]
    feats = target_features(target, torch.tensor([prompt]))[0]            # (P, C)
    first = 17
    d.open_session("s", prompt, SamplingParams(0.0))
    hs = HiddenStates.encode(feats, "float16")
    prop = d.propose("s", [], [first], DraftShape.chain(4), hidden=hs)
    want = reference_draft(head, parts, hs.decode(), prompt + [first], 4)
    assert prop.tree.tokens == want
    # Row features of the committed pairs equal the module's outputs.
    emb = parts.embed[torch.tensor(prompt[1:] + [first])][None]
    ref = head(emb, hs.decode()[None])[0]
    got = d._sessions["s"].cache.feats[:len(prompt)]
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    # A static tree's first-choice chain is the same chain (parents from the mask).
    d.open_session("t", prompt, SamplingParams(0.0))
    tree = d.propose("t", [], [first], DraftShape(branching=(2, 2, 1, 1)), hidden=hs).tree
    chain, node = [], -1
    for _ in range(4):
        node = [i for i, p in enumerate(tree.parents) if p == node][0]
        chain.append(tree.tokens[node])
    assert chain == want


@pytest.mark.unit
@torch.inference_mode()
def test_verifier_features_are_the_target_hidden_states(eagle_pair):
    """Prefill: one row per prompt token; verify: the root and the kept path,
    equal to the target's pre-norm last-layer states of the committed sequence."""
    target_dir, _ = eagle_pair
    target = load_model(target_dir, "cpu")
    v = Verifier(VerifierConfig(target_dir, device="cpu"))
    prompt = [40, 41, 42, 43, 44]
    first, h0 = v.open_session("s", prompt, SamplingParams(0.0), hidden=True)
    assert h0.rows == len(prompt)
    seq = prompt + [first]
    greedy = target.generate(torch.tensor([seq]), do_sample=False, max_new_tokens=3, pad_token_id=0)[0, len(seq):]
    # A tree whose first branch is the target's greedy path (kept) and a wrong sibling.
    draft = [int(greedy[0]), (int(greedy[0]) + 1) % 384, int(greedy[1])]
    r = v.verify("s", draft, [-1, -1, 0])
    assert r.path == [0, 2] and r.hidden.rows == 3
    full = target_features(target, torch.tensor([seq + r.tokens[:-1]]))[0]
    got = torch.cat([h0.decode(), r.hidden.decode()])
    assert got.shape == full.shape
    assert torch.allclose(got, full, atol=2e-2, rtol=2e-3), (got - full).abs().max()


@pytest.mark.services
def test_eagle_greedy_equals_target_only(eagle_pair, eagle_stack):
    target_dir, _ = eagle_pair
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    shapes = [dict(num_speculative_tokens=1), dict(num_speculative_tokens=4),
              dict(tree={"branching": [3, 2, 1]}), dict(tree={"node_budget": 8, "max_depth": 4, "top_k": 3})]
    accepted = drafted = 0
    for p in prompts(tok, 8):
        want, gaps = reference(model, p)
        for shape in shapes:
            got, last = eagle_stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW, **shape)
            assert_same_or_near_tie(got, want, gaps, f"eagle {shape}")
            s = last.stats
            assert s.method == "eagle"
            # Every committed token but the newest sent its feature, 2 bytes x hidden:
            # the prompt's, then each cycle's committed tokens (some may lie past EOS).
            committed = round(s.mean_accepted_length * s.cycles)
            assert committed >= len(got) - 1
            assert s.feature_bytes == 2 * model.config.hidden_size * (len(p) + committed)
            accepted, drafted = accepted + s.accepted_tokens, drafted + s.drafted_tokens
    print(f"eagle greedy: accepted {accepted} of {drafted} drafted")
    assert 0 < accepted < drafted


@pytest.mark.services
def test_eagle_constrained_greedy_equals_target_only(eagle_pair, eagle_stack):
    """Structured output with method eagle: the head's drafts are masked like a
    draft model's, and the output is target-only constrained greedy."""
    import llguidance.hf

    from tests.test_structured_greedy import CONSTRAINTS, constrained_greedy, grammar_of

    target_dir, _ = eagle_pair
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    lltok = llguidance.hf.from_tokenizer(tok)
    drafted = 0
    for kind, field in CONSTRAINTS.items():
        grammar = grammar_of(kind, next(iter(field.values())))
        for p in prompts(tok, 2):
            want, gaps = constrained_greedy(model, lltok, grammar, p, tok.eos_token_id, MAX_NEW)
            for shape in (dict(num_speculative_tokens=3), dict(tree={"branching": [2, 2]})):
                got, last = eagle_stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW,
                                                 structured_output=field, **shape)
                assert_same_or_near_tie(got, want, gaps, f"eagle {kind} {shape}")
                assert last.stats.method == "eagle"
                drafted += last.stats.drafted_tokens
    assert drafted > 0


@torch.inference_mode()
def head_joint(target_dir, head_dir, prompt, params: SamplingParams, eps=1e-7) -> dict:
    """The law of 3 tokens if every draft were kept: token 1 from the target,
    tokens 2-3 from the head (token 3 on its own predicted feature)."""
    target, head = load_model(target_dir, "cpu"), load_head(head_dir)
    parts = TargetParts.of(target)
    p1 = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1], params)
    joint = {}
    for x1 in torch.nonzero(p1 > eps).flatten().tolist():
        feats = target_features(target, torch.tensor([prompt]))[0]
        emb = parts.embed[torch.tensor(prompt[1:] + [x1])]
        f2 = head(emb[None], feats[None])[0, -1]
        q2 = logits_to_probs(parts.logits(f2), params)
        for x2 in torch.nonzero(q2 > eps).flatten().tolist():
            f3 = head(torch.cat([emb, parts.embed[x2][None]])[None], torch.cat([feats, f2[None]])[None])[0, -1]
            q3 = logits_to_probs(parts.logits(f3), params)
            for x3 in torch.nonzero(q3 > eps).flatten().tolist():
                joint[(x1, x2, x3)] = float(p1[x1] * q2[x2] * q3[x3])
    return joint


@pytest.mark.parametrize("prompt,temperature,top_p,top_k,draft", [
    ([40, 41, 42, 43, 44], 1.0, 1.0, 6, dict(num_speculative_tokens=2)),
    ([100, 7, 9], 0.7, 0.8, 0, dict(tree={"branching": [2, 2]})),
    ([40, 41, 42, 43, 44], 1.0, 1.0, 6, dict(tree={"node_budget": 6, "max_depth": 3, "top_k": 3})),
], ids=["chain-T1", "static22-T0.7p0.8", "dynamic6-T1"])
@pytest.mark.services
@pytest.mark.statistical
def test_eagle_sampling_matches_target(prompt, temperature, top_p, top_k, draft, eagle_pair, eagle_stack):
    target_dir, head_dir = eagle_pair
    params = SamplingParams(temperature, top_p, top_k)
    joint = exact_joint(target_dir, prompt, params)
    threshold = null_threshold(joint, N)
    # Power: a rule that kept every draft would follow the head's law, which
    # this threshold must be able to tell from the target's.
    assert tv(joint, {k: v * N for k, v in head_joint(target_dir, head_dir, prompt, params).items()}, N) \
        > 2 * threshold
    check_stream_law(eagle_stack, prompt, joint, threshold,
                     dict(temperature=temperature, top_p=top_p, top_k=top_k, **draft))


@pytest.mark.unit
def test_loop_forwards_features_without_extra_calls(pairs):
    """The loop with counting fake services: one Propose and one Verify per
    cycle (as for draft_model), and each Propose carries exactly the features
    of the tokens committed since the last one, in order, the prompt's with
    the first; the feature bytes count every committed token but the newest."""
    import asyncio

    from orchestrator.cycle.detok import OutputTracker
    from orchestrator.cycle.loop import ContextLengths, Draft, SessionReplicas, Verdict, run_generation
    from orchestrator.cycle.spec import GenerationSpec

    target_dir, _ = pairs["llama"]
    tok = load_tokenizer(target_dir)
    calls = {"open": 0, "propose": 0, "verify": 0}
    sent_positions: list[float] = []          # feature rows the drafter got, by position

    def feats(positions):                      # row value = the token's position
        return HiddenStates.encode(torch.tensor(positions, dtype=torch.float32)[:, None].repeat(1, 4))

    class Verifier:
        n = 0                                  # committed tokens

        async def open(self, sid, prompt, sampling, *, hidden=False):
            calls["open"] += 1
            assert hidden
            self.n = len(prompt) + 1
            return 5, feats(list(range(len(prompt))))

        async def verify(self, sid, draft):
            calls["verify"] += 1
            path = list(range(len(draft.tokens) // 2))          # keep half the chain
            tokens = [draft.tokens[i] for i in path] + [7]
            h = feats(list(range(self.n - 1, self.n - 1 + len(tokens))))   # the root and the path
            self.n += len(tokens)
            return Verdict(path, tokens, hidden=h)

        async def close(self, sid):
            pass

    class Drafter:
        async def open(self, sid, prompt, sampling):
            pass

        async def propose(self, sid, path, committed, shape, *, ahead=False, rewind=False, hidden=None):
            calls["propose"] += 1
            sent_positions.extend(hidden.decode()[:, 0].tolist())
            return Draft([9] * shape.depth, list(range(-1, shape.depth - 1)))

        async def close(self, sid):
            pass

    prompt = [1, 2, 3, 4]
    spec = GenerationSpec(prompt, 20, SamplingParams(0.0), "eagle", DraftShape.chain(4))
    tracker = OutputTracker(tok, set(), 20, 200)
    verifier = Verifier()

    async def go():
        return [c async for c in run_generation(spec, SessionReplicas("s", verifier, Drafter()), tracker,
                                                ContextLengths(256, 256))]

    chunks = asyncio.run(go())
    stats = chunks[-1].stats
    assert calls["open"] == 1 and calls["verify"] == stats.cycles and calls["propose"] == stats.drafts
    assert stats.drafts < stats.cycles          # the last cycles had no room for a draft
    # Every feature sent reached the drafter once, in order, the prompt's first.
    assert sent_positions == list(range(len(sent_positions)))
    assert stats.feature_bytes == 2 * 4 * (verifier.n - 1)


@pytest.mark.unit
def test_eagle_drafter_refuses_bad_features(eagle_pair):
    from specd_core.errors import InvalidRequest

    _, head_dir = eagle_pair
    d = EagleDrafter(DrafterConfig(head_dir, device="cpu"))
    prompt = [40, 41, 42]
    d.open_session("s", prompt, SamplingParams(0.0))
    good = HiddenStates.encode(torch.zeros(3, 64))
    for bad in (None, HiddenStates.encode(torch.zeros(2, 64)), HiddenStates.encode(torch.zeros(3, 32)),
                HiddenStates(good.data[:-2], 3, 64), HiddenStates.encode(torch.full((3, 64), float("inf")))):
        with pytest.raises(InvalidRequest):
            d.propose("s", [], [17], DraftShape.chain(2), hidden=bad)
    with pytest.raises(InvalidRequest):
        d.propose("s", [], [17], DraftShape.chain(2), ahead=True, hidden=good)
    assert len(d.propose("s", [], [17], DraftShape.chain(2), hidden=good).tree.tokens) == 2


@pytest.mark.parametrize("dtype,tol", [("float16", 1e-3), ("bfloat16", 8e-3)])
@pytest.mark.unit
def test_hidden_states_round_trip(dtype, tol):
    t = torch.randn(5, 8) * 9
    h = HiddenStates.encode(t, dtype)
    assert len(h.data) == 2 * 5 * 8 and (h.rows, h.hidden_size, h.dtype) == (5, 8, dtype)
    assert torch.allclose(h.decode(), t, rtol=tol, atol=tol * 9)
    both = HiddenStates.concat([h, None, HiddenStates.encode(t[:2], dtype)])
    assert both.rows == 7 and torch.equal(both.decode()[5:], h.decode()[:2])
    with pytest.raises(ValueError):
        HiddenStates.concat([h, HiddenStates.encode(t, "float16" if dtype == "bfloat16" else "bfloat16")])

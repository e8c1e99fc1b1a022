"""Published draft heads: EAGLE-3 (method eagle3) and EAGLE-1/2 (method eagle),
saved here in their published formats with random weights.

* The serving drafter's draft distributions equal an independent reference
  forward written below from each method's definition in plain torch (it
  imports nothing of specd's serving code), d2t mapping included, and the
  verifier's auxiliary features equal Hugging Face's hidden states;
* through the real services, greedy output equals target-only greedy
  decoding, chains and trees, for both methods (the EAGLE-3 stack is
  configured by a vLLM-style JSON speculative config file);
* a head whose shapes do not fit the target is refused before anything
  starts, with one line naming the mismatch;
* EAGLE-3 sampling follows the target's exact law (statistical).

The target has 8 layers so that the published default auxiliary layers
(2, L // 2, L - 3) = (2, 4, 5) exist; the EAGLE-3 head's draft vocabulary is
smaller than the target's and its d2t is a non-trivial offset table.
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from drafter_svc.config import DrafterConfig
from drafter_svc.eagle import make_drafter
from orchestrator.pair import IncompatiblePair, check_pair
from specd.local_stack import Stack
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams, logits_to_probs
from specd_core.runtime.features import HiddenStates
from specd_core.runtime.models import load_model, load_tokenizer
from specd_core.runtime.propose_call import ProposeCall
from tests.test_greedy_exact import MAX_NEW, assert_same_or_near_tie, prompts, reference
from tests.test_sampling_lossless import N, check_stream_law, exact_joint, null_threshold, tv
from tests.tiny_models import corpus_lines
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

LAYERS, HIDDEN, HEADS, KV_HEADS, MLP = 8, 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
THETA, EPS = 10000.0, 1e-6
AUX = (1, 4, 6)  # the EAGLE-3 head's configured auxiliary layers
DRAFT_VOCAB = 200


# ----- the heads, saved in their published formats ---------------------------------------


def build_target(out: Path, tokenizer_dir: str) -> str:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(5)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=len(tok),
                      max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=EPS,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(15)  # peaked distributions, as tests/tiny_models.py does
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _layer(prefix: str, g: torch.Generator, attn_in: int) -> dict:
    """A Llama decoder layer's weights (random, norms around 1)."""
    def r(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale
    w = {f"{prefix}.self_attn.{n}.weight": r(HEADS * HEAD_DIM if n == "q_proj" else KV_HEADS * HEAD_DIM, attn_in)
         for n in ("q_proj", "k_proj", "v_proj")}
    w[f"{prefix}.self_attn.o_proj.weight"] = r(HIDDEN, HEADS * HEAD_DIM)
    w[f"{prefix}.mlp.gate_proj.weight"] = r(MLP, HIDDEN)
    w[f"{prefix}.mlp.up_proj.weight"] = r(MLP, HIDDEN)
    w[f"{prefix}.mlp.down_proj.weight"] = r(HIDDEN, MLP)
    w[f"{prefix}.post_attention_layernorm.weight"] = 1 + r(HIDDEN, scale=0.2)
    return w


def _llama_fields(vocab: int) -> dict:
    # A shorter context than the target's, as published heads often state: it drafts there anyway.
    return dict(hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=EPS, rope_theta=THETA,
                max_position_embeddings=64, hidden_act="silu", num_hidden_layers=1, vocab_size=vocab)


def eagle3_weights(vocab: int, seed: int = 11, target_hidden: int = HIDDEN, draft_ids=None,
                   embed: bool = False) -> dict:
    """An EAGLE-3 head's tensors as published: fc / midlayer / norm / lm_head over
    a draft vocabulary (draft_ids: the target ids it covers, in id order;
    default a random subset), d2t offsets and the t2d mask."""
    g = torch.Generator().manual_seed(seed)
    w = _layer("midlayer", g, 2 * HIDDEN)
    w["midlayer.input_layernorm.weight"] = 1 + torch.randn(HIDDEN, generator=g) * 0.2
    w["midlayer.hidden_norm.weight"] = 1 + torch.randn(HIDDEN, generator=g) * 0.2
    w["fc.weight"] = torch.randn(HIDDEN, 3 * target_hidden, generator=g) * 0.1
    w["norm.weight"] = 1 + torch.randn(HIDDEN, generator=g) * 0.2
    w["lm_head.weight"] = torch.randn(DRAFT_VOCAB, HIDDEN, generator=g) * 2.0
    ids = draft_ids if draft_ids is not None else torch.sort(torch.randperm(vocab, generator=g)[:DRAFT_VOCAB]).values
    w["d2t"] = ids - torch.arange(DRAFT_VOCAB)  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    if embed:
        w["embed_tokens.weight"] = torch.randn(vocab, HIDDEN, generator=g)
    return w


def save_eagle3_head(out: Path, vocab: int, w: dict | None = None, aux=AUX, **weights) -> str:
    """An EAGLE-3 head directory: LlamaForCausalLMEagle3 config, safetensors weights."""
    w = w if w is not None else eagle3_weights(vocab, **weights)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **_llama_fields(vocab),
           "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": w["fc.weight"].shape[1] // 3,
           "torch_dtype": "float32"}
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    return _save(out, cfg, w)


def eagle1_weights(vocab: int, seed: int = 12, hidden: int = HIDDEN, embed: bool = True) -> dict:
    """An EAGLE-1/2 head's tensors as published: fc (with bias) over [embed;
    feature], layers.0.* (its unused input norm included), embed_tokens."""
    g = torch.Generator().manual_seed(seed)
    w = _layer("layers.0", g, HIDDEN)
    w["layers.0.input_layernorm.weight"] = torch.ones(HIDDEN)  # in the file, not applied (EAGLE's layer 0)
    w["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    w["fc.bias"] = torch.randn(hidden, generator=g) * 0.1
    if embed:
        w["embed_tokens.weight"] = torch.randn(vocab, HIDDEN, generator=g)
    return w


def save_eagle1_head(out: Path, vocab: int, w: dict | None = None, **weights) -> str:
    w = w if w is not None else eagle1_weights(vocab, **weights)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_llama_fields(vocab),
           "hidden_size": w["fc.weight"].shape[0], "torch_dtype": "float32"}
    return _save(out, cfg, w)


def _save(out: Path, cfg: dict, w: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.detach().contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    return str(out)


# ----- a few seconds of distillation, so that drafts are sometimes kept -------------------


def distillation_data(target, tokenizer, windows: int = 24, length: int = 48):
    """Corpus windows, the target's hidden states over them (HF: [i] enters
    layer i, [-1] after the final norm) and its next-token distribution at each position."""
    ids = torch.tensor(tokenizer("\n".join(corpus_lines(600)))["input_ids"])
    starts = torch.linspace(0, len(ids) - length - 1, windows).long()
    x = torch.stack([ids[s:s + length] for s in starts])
    with torch.no_grad():
        out = target(x, output_hidden_states=True)
    return x, out.hidden_states, out.logits.softmax(-1)


def train(w: dict, names: list[str], loss_of, steps: int = 300) -> None:
    """Adam on the named tensors of w, one window per step."""
    params = [w[n].requires_grad_() for n in names]
    opt = torch.optim.Adam(params, lr=3e-3)
    for step in range(steps):
        loss = loss_of(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n in names:
        w[n] = w[n].detach()


def trained_eagle3(target, tokenizer, vocab: int) -> dict:
    """Row i = (x_{i+1}, aux_i) learns the target's distribution after x_{i+1};
    the draft vocabulary is the target's most probable tokens over the data
    (as the published heads choose theirs by frequency)."""
    x, hs, p = distillation_data(target, tokenizer)
    mass = p.sum((0, 1)) + torch.rand(vocab) * 1e-6
    ids = torch.sort(torch.topk(mass, DRAFT_VOCAB).indices).values
    w = eagle3_weights(vocab, draft_ids=ids)
    soft = p[..., ids] / p[..., ids].sum(-1, keepdim=True)  # the target's law on the draft vocabulary
    aux = torch.cat([hs[i] for i in AUX], -1)  # (windows, T, 3C)
    embed = target.model.embed_tokens.weight.detach()

    def loss_of(step):
        j = step % x.shape[0]
        h = aux[j, :-1] @ w["fc.weight"].T
        out = ref_eagle3_rows(w, embed, x[j, 1:].tolist(), h)
        return F.cross_entropy(ref_rms(out, w["norm.weight"]) @ w["lm_head.weight"].T, soft[j, 1:])

    train(w, [n for n in w if n not in ("d2t", "t2d")], loss_of)
    return w


def trained_eagle1(target, tokenizer, vocab: int) -> dict:
    """As trained_eagle3, on the target's last hidden state after its final norm."""
    x, hs, p = distillation_data(target, tokenizer)
    w = eagle1_weights(vocab)
    w["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()  # shipped, as some are
    lm_head = target.lm_head.weight.detach()

    def loss_of(step):
        j = step % x.shape[0]
        xin = torch.cat([w["embed_tokens.weight"][x[j, 1:]], hs[-1][j, :-1]], -1) @ w["fc.weight"].T + w["fc.bias"]
        return F.cross_entropy(ref_layer(w, "layers.0", xin, xin) @ lm_head.T, p[j, 1:])

    train(w, [n for n in w if n not in ("layers.0.input_layernorm.weight", "embed_tokens.weight")], loss_of)
    return w


@pytest.fixture(scope="module")
def heads(pairs, tmp_path_factory):
    root = tmp_path_factory.mktemp("published-heads")
    target_dir = build_target(root / "target8", pairs["llama"][0])
    tok = load_tokenizer(target_dir)
    vocab = len(tok)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    torch.manual_seed(0)
    return {
        "target": target_dir,
        "vocab": vocab,
        "eagle3": save_eagle3_head(root / "eagle3", vocab, trained_eagle3(target, tok, vocab)),
        "eagle3_default": save_eagle3_head(root / "eagle3-default", vocab, aux=None, seed=13, embed=True),
        "eagle": save_eagle1_head(root / "eagle1", vocab, trained_eagle1(target, tok, vocab)),
    }


# ----- the reference forward, from the methods' definitions --------------------------------


def ref_rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def ref_rope(x):  # x: (heads, T, d); Llama's rotate-half RoPE at positions 0..T-1
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2).float() / d)
    ang = torch.outer(torch.arange(x.shape[1]).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def ref_layer(w: dict, p: str, attn_in, residual):
    """One decoder layer: causal attention reading attn_in (T, *), added to
    residual (T, C); then the SwiGLU MLP block."""
    t = attn_in.shape[0]
    q = (attn_in @ w[f"{p}.self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM).transpose(0, 1)
    k = (attn_in @ w[f"{p}.self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = (attn_in @ w[f"{p}.self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)
    q, k = ref_rope(q), ref_rope(k)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1) @ w[f"{p}.self_attn.o_proj.weight"].T
    h = residual + y
    m = ref_rms(h, w[f"{p}.post_attention_layernorm.weight"])
    mlp = (F.silu(m @ w[f"{p}.mlp.gate_proj.weight"].T) * (m @ w[f"{p}.mlp.up_proj.weight"].T))
    return h + mlp @ w[f"{p}.mlp.down_proj.weight"].T


def ref_eagle3_rows(w: dict, embed, tokens: list[int], h):
    """EAGLE-3's layer over rows (token i, h_i): attention reads
    [input_layernorm(embed); hidden_norm(h)], the residual stream is h."""
    e = embed[torch.tensor(tokens)]
    attn_in = torch.cat([ref_rms(e, w["midlayer.input_layernorm.weight"]),
                         ref_rms(h, w["midlayer.hidden_norm.weight"])], -1)
    return ref_layer(w, "midlayer", attn_in, h)


def ref_eagle3_probs(w: dict, embed, tokens: list[int], feats: list[torch.Tensor], vocab: int):
    """EAGLE-3: row i = (token i, feature i) where a feature is 3H wide (the
    target's auxiliary states, read through fc) or H wide (the head's own
    output before norm). Returns (probabilities over the TARGET ids after the
    last row, the last row's output)."""
    h = torch.stack([w["fc.weight"] @ f if f.shape[0] != HIDDEN else f for f in feats])
    out = ref_eagle3_rows(w, embed, tokens, h)
    draft = (ref_rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T).softmax(-1)
    probs = torch.zeros(vocab)
    probs[torch.arange(len(draft)) + w["d2t"]] = draft  # target id = draft id + d2t[draft id]
    return probs, out[-1]


def ref_eagle1_probs(w: dict, embed, lm_head, tokens: list[int], feats: list[torch.Tensor]):
    """EAGLE-1/2: x = fc([embed; feature]) + b, one decoder layer with no input
    norm, the target's LM head on its output (no norm). Features: the target's
    after its final norm, or the head's own output."""
    x = torch.cat([embed[torch.tensor(tokens)], torch.stack(feats)], -1) @ w["fc.weight"].T + w["fc.bias"]
    out = ref_layer(w, "layers.0", x, x)
    return (out[-1] @ lm_head.T).softmax(-1), out[-1]


def hf_hidden_states(target, ids: list[int]):
    with torch.no_grad():
        return target(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i]: entering layer i


# ----- unit: the drafter's distributions against the reference -----------------------------


def _drafter_chain(d, feats_wire: HiddenStates, tokens: list[int], steps: int):
    """The serving drafter's distributions (its HeadRunner, what Propose drafts
    through) after the committed rows, then along its own greedy chain."""
    runner = d.runner
    s = runner.new_session()
    logits = runner.feed_batch([(s, tokens, feats_wire.decode())])[0][-1]
    out = [logits.softmax(-1)]
    for _ in range(steps - 1):
        logits = runner.forward_batch([(s, [int(out[-1].argmax())], None, None)])[0][-1]
        out.append(logits.softmax(-1))
    return out


@pytest.mark.unit
@torch.inference_mode()
@pytest.mark.parametrize("which", ["eagle3", "eagle3_default"])
def test_eagle3_drafter_equals_reference_forward(heads, which):
    from safetensors.torch import load_file

    target_dir, head_dir, vocab = heads["target"], heads[which], heads["vocab"]
    aux = AUX if which == "eagle3" else (2, LAYERS // 2, LAYERS - 3)
    w = load_file(str(Path(head_dir) / "model.safetensors"))
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    embed = w.get("embed_tokens.weight", target.model.embed_tokens.weight)
    prompt, first = [40, 41, 42, 43, 44, 45], 17
    # The verifier streams the auxiliary layers' states side by side: HF's hidden_states[i].
    v = Verifier(VerifierConfig(target_dir, device="cpu"))
    _, wire = v.open_session("s", prompt, SamplingParams(0.0), hidden=aux)
    hs = hf_hidden_states(target, prompt)
    want = torch.cat([hs[i][0] for i in aux], -1)
    assert wire.hidden_size == 3 * HIDDEN and torch.allclose(wire.decode(), want, atol=2e-2, rtol=2e-3)

    d = make_drafter(DrafterConfig(head_dir, target_dir=target_dir, device="cpu"))
    assert d.method.name == "eagle3" and d.vocab_size == vocab and d.context_length == 256  # the target's
    got = _drafter_chain(d, wire, prompt[1:] + [first], 4)
    # The reference, on the same (fp16-rounded) features, its own outputs fed back.
    tokens, feats, chain = prompt[1:] + [first], list(wire.decode()), []
    reachable = torch.zeros(vocab, dtype=torch.bool)
    reachable[torch.arange(DRAFT_VOCAB) + w["d2t"]] = True
    for q in got:
        p, last = ref_eagle3_probs(w, embed, tokens, feats, vocab)
        assert torch.allclose(q, p, atol=1e-5), (q - p).abs().max()
        assert float(q[~reachable].sum()) == 0.0  # no mass on ids the head cannot produce
        chain.append(int(p.argmax()))
        tokens, feats = tokens + [chain[-1]], feats + [last]
    # Propose drafts the same greedy chain (chain and static tree's first choices).
    d.open_session("c", prompt, SamplingParams(0.0))
    assert d.propose(ProposeCall("c", [], [first], DraftShape.chain(4), hidden=wire)).tree.tokens == chain
    # Sampled children carry a q on reachable ids only.
    d.open_session("q", prompt, SamplingParams(1.0, seed=3))
    prop = d.propose(ProposeCall("q", [], [first], DraftShape(branching=(3, 2)), hidden=wire))
    assert all(reachable[t] for t in prop.tree.tokens)


@pytest.mark.unit
@torch.inference_mode()
def test_published_eagle_drafter_equals_reference_forward(heads):
    from safetensors.torch import load_file

    target_dir, head_dir = heads["target"], heads["eagle"]
    w = load_file(str(Path(head_dir) / "model.safetensors"))
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    prompt, first = [40, 41, 42, 43, 44, 45], 17
    v = Verifier(VerifierConfig(target_dir, device="cpu"))
    _, wire = v.open_session("s", prompt, SamplingParams(0.0), hidden=True)  # before the final norm
    post = ref_rms(wire.decode(), target.model.norm.weight)
    # After the target's final norm, it is what the target's model returns.
    assert torch.allclose(post, hf_hidden_states(target, prompt)[-1][0], atol=3e-2, rtol=3e-3)
    d = make_drafter(DrafterConfig(head_dir, target_dir=target_dir, device="cpu"))
    assert d.method.name == "eagle"
    got = _drafter_chain(d, wire, prompt[1:] + [first], 4)
    tokens, feats, chain = prompt[1:] + [first], list(post), []
    for q in got:
        p, last = ref_eagle1_probs(w, w["embed_tokens.weight"], target.lm_head.weight, tokens, feats)
        assert torch.allclose(q, p, atol=1e-5), (q - p).abs().max()
        chain.append(int(p.argmax()))
        tokens, feats = tokens + [chain[-1]], feats + [last]
    d.open_session("c", prompt, SamplingParams(0.0))
    assert d.propose(ProposeCall("c", [], [first], DraftShape.chain(4), hidden=wire)).tree.tokens == chain


@pytest.mark.unit
def test_a_constraint_allowing_nothing_the_head_can_draft():
    """Structured output may allow only ids outside an EAGLE-3 head's draft
    vocabulary: the drafter then drafts from its own law (rejected by the
    verifier, whose p is 0 there) rather than from a law of NaNs."""
    from drafter_svc.tree_builder import _choose, masked_row

    class OnlyId:
        def allowed(self, path):
            mask = torch.zeros(8, dtype=torch.bool)
            mask[5] = True
            return mask

    logits = torch.tensor([1.0, 2.0, 0.5, float("-inf"), 0.0, float("-inf"), 0.1, -1.0])  # id 5: not drafted
    row = masked_row(OnlyId(), logits, [])
    assert torch.equal(row, logits)
    ids, (q_ids, q), _ = _choose(row, 2, SamplingParams(1.0, seed=1), 8, torch.Generator().manual_seed(0))
    assert all(math.isfinite(p) for p in q) and 5 not in ids
    allowed_one = logits.clone()
    allowed_one[5] = 0.0
    assert int(masked_row(OnlyId(), allowed_one, []).argmax()) == 5  # otherwise the mask as before


@pytest.mark.unit
@torch.inference_mode()
def test_one_verifier_batch_serves_each_session_its_own_layers(heads):
    """Sessions asking for different features share one forward (a prefill
    batch here): each gets its own layers' states, in its own order."""
    target_dir = heads["target"]
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    v = Verifier(VerifierConfig(target_dir, device="cpu"))
    prompt = [40, 41, 42, 43]
    asks = {"last": True, "aux": AUX, "reversed": (6, 1), "none": False}
    jobs = [v.prepare_open(sid, prompt, SamplingParams(0.0), hidden=h) for sid, h in asks.items()]
    got = dict(zip(asks, v.verify_batch(jobs)))
    hs = hf_hidden_states(target, prompt)
    want = {"aux": torch.cat([hs[i][0] for i in AUX], -1), "reversed": torch.cat([hs[6][0], hs[1][0]], -1)}
    for sid, w in want.items():
        assert torch.allclose(got[sid][1].decode(), w, atol=2e-2, rtol=2e-3), sid
    post = ref_rms(got["last"][1].decode(), target.model.norm.weight)  # the last layer's, before the norm
    assert torch.allclose(post, hs[-1][0], atol=3e-2, rtol=3e-3)
    assert isinstance(got["none"], int)
    # A verify returns the root's and the kept path's: a tree whose first branch
    # is the target's greedy path (kept) and a wrong sibling.
    seq = prompt + [got["aux"][0]]
    greedy = target.generate(torch.tensor([seq]), do_sample=False, max_new_tokens=2, pad_token_id=0)[0, len(seq):]
    r = v.verify("aux", [int(greedy[0]), (int(greedy[0]) + 1) % heads["vocab"], int(greedy[1])], [-1, -1, 0])
    assert r.path == [0, 2] and r.hidden.rows == 3
    hs = hf_hidden_states(target, seq + r.tokens[:-1])
    full = torch.cat([hs[i][0] for i in AUX], -1)
    assert torch.allclose(torch.cat([got["aux"][1].decode(), r.hidden.decode()]), full, atol=2e-2, rtol=2e-3)
    with pytest.raises(Exception, match="hidden_layers"):
        v.prepare_open("bad", prompt, SamplingParams(0.0), hidden=(1, LAYERS + 1))


# ----- unit: heads that do not fit --------------------------------------------------------


@pytest.mark.unit
def test_a_model_with_damaged_weights_is_not_taken_for_a_head(heads, tmp_path):
    """A drafter directory whose weights cannot be read is no head: the
    format check passes it on (loading it as a model then reports the damage
    in one line, tests/test_up_errors.py) instead of raising from the check."""
    from specd_core.runtime.head_formats import head_format

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN}))
    (damaged / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    assert head_format(damaged) is None
    assert head_format(heads["eagle"]) == "eagle"  # the same check still reads a published head


@pytest.mark.unit
def test_a_head_that_does_not_fit_is_refused_naming_the_mismatch(heads, tmp_path):
    target, vocab = heads["target"], heads["vocab"]
    bad = {
        "target_hidden_size 32": save_eagle3_head(tmp_path / "h", vocab, target_hidden=32),
        f"vocab_size {vocab + 8}": save_eagle3_head(tmp_path / "v", vocab + 8),
        "layer ids [1, 4, 9] out of range": save_eagle3_head(tmp_path / "a", vocab, aux=(1, 4, 9)),
        "hidden_size 32": save_eagle1_head(tmp_path / "e", vocab, hidden=32, embed=False),
    }
    for needle, head in bad.items():
        with pytest.raises(IncompatiblePair) as e:
            check_pair(target, head)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
        with pytest.raises(ValueError, match="does not fit"):
            make_drafter(DrafterConfig(head, target_dir=target, device="cpu"))
        # Before anything starts: the local stack checks the pair first.
        with pytest.raises(IncompatiblePair, match="does not fit"):
            Stack(target, head)
    check_pair(target, heads["eagle3"])  # the good ones fit
    check_pair(target, heads["eagle"])


@pytest.mark.unit
def test_specd_up_with_method_eagle3(heads, tmp_path, monkeypatch, up_without_ray, capsys):
    """`specd up --method eagle3 --drafter HEAD`: a head that does not fit is
    refused before Ray starts, in one line naming the mismatch; one that fits
    goes on to Ray with its drafter replicas told where the target is."""
    from specd import ray_deploy
    from specd.cli import deploy
    from specd.cli.parser import build_parser

    deployed = up_without_ray
    bad = save_eagle3_head(tmp_path / "bad", heads["vocab"], aux=(1, 4, 9))
    args = build_parser().parse_args(["up", "--target", heads["target"], "--drafter", bad, "--method", "eagle3"])
    assert deploy.cmd_up(args) == 2 and not deployed
    err = capsys.readouterr().err.strip()
    assert err.startswith("specd up: eagle3 head") and "layer ids [1, 4, 9] out of range" in err
    assert "\n" not in err

    assert deploy.cmd_up(build_parser().parse_args(["up", "--target", heads["target"], "--method", "eagle3"])) == 2
    assert "method eagle3 needs an EAGLE-3 head" in capsys.readouterr().err and not deployed

    good = ["up", "--target", heads["target"], "--drafter", heads["eagle3"], "--method", "eagle3"]
    captured = {}
    monkeypatch.setattr(deploy, "_with_models", lambda cfg, models: captured.setdefault("cfg", cfg))
    assert deploy.cmd_up(build_parser().parse_args(good)) == 1 and deployed  # it went on to Ray
    cfg = dataclasses.replace(captured["cfg"], target_dir=heads["target"], drafter_dir=heads["eagle3"])
    assert cfg.speculative.method == "eagle3"
    assert ray_deploy.replica_fields(cfg, "drafter")["target_dir"] == heads["target"]


# ----- services: greedy exactness, sampling law --------------------------------------------


@pytest.fixture(scope="module")
def eagle3_stack(heads, tmp_path_factory):
    # vLLM's speculative config, unchanged: {"method": "eagle3", "model": ..., "num_speculative_tokens": ...}
    spec = tmp_path_factory.mktemp("spec") / "speculative.json"
    spec.write_text(json.dumps({"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 3}))
    stack = Stack(heads["target"], heads["eagle3"], orchestrator_args=("--speculative-config", str(spec)))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def eagle1_stack(heads):
    stack = Stack(heads["target"], heads["eagle"], orchestrator_args=("--method", "eagle"))
    yield stack
    stack.stop()


SHAPES = [dict(num_speculative_tokens=1), dict(num_speculative_tokens=4),
          dict(tree={"branching": [3, 2, 1]}), dict(tree={"node_budget": 8, "max_depth": 4, "top_k": 3})]


def _greedy_equals_target(stack, target_dir: str, method: str, feature_width: int) -> None:
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    accepted = drafted = 0
    for p in prompts(tok, 4):
        want, gaps = reference(model, p)
        for shape in SHAPES:
            got, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW, **shape)
            assert_same_or_near_tie(got, want, gaps, f"{method} {shape}")
            s = last.stats
            assert s.method == method and s.drafted_tokens > 0
            committed = round(s.mean_accepted_length * s.cycles)
            assert s.feature_bytes == 2 * feature_width * (len(p) + committed)
            accepted, drafted = accepted + s.accepted_tokens, drafted + s.drafted_tokens
    print(f"{method} greedy: accepted {accepted} of {drafted} drafted")
    assert 0 < accepted < drafted  # both paths ran: kept drafts and rejections


@pytest.mark.services
def test_eagle3_greedy_equals_target_only(heads, eagle3_stack):
    _greedy_equals_target(eagle3_stack, heads["target"], "eagle3", 3 * HIDDEN)


@pytest.mark.services
def test_published_eagle_greedy_equals_target_only(heads, eagle1_stack):
    _greedy_equals_target(eagle1_stack, heads["target"], "eagle", HIDDEN)


@pytest.mark.services
def test_status_says_what_each_drafter_drafts_with(heads, eagle3_stack, eagle1_stack, capsys):
    """`specd status` names each drafter's method and head, and a published
    EAGLE-3 head's draft vocabulary against the target's."""
    from specd.cli import main

    for stack, want in (
        (eagle3_stack, f"eagle3: published EAGLE-3 head, draft vocabulary {DRAFT_VOCAB} of the target's {heads['vocab']}"),
        (eagle1_stack, "eagle: published EAGLE-1/2 head"),
    ):
        assert main(["status", "--address", stack.orchestrator.address]) == 0
        out = capsys.readouterr().out
        assert f"drafter-0 drafts with {want}\n" in out, out


@pytest.mark.services
def test_eagle3_constrained_decoding(heads, eagle3_stack):
    """Structured output with a draft vocabulary smaller than the target's:
    greedy output is target-only constrained greedy, and sampled requests run
    to their end (a constraint may allow nothing the head can draft)."""
    import llguidance.hf

    from tests.test_structured_greedy import CONSTRAINTS, constrained_greedy, grammar_of

    model, tok = load_model(heads["target"], "cpu"), load_tokenizer(heads["target"])
    lltok = llguidance.hf.from_tokenizer(tok)
    for kind, field in CONSTRAINTS.items():
        p = prompts(tok, 2)[1]
        want, gaps = constrained_greedy(model, lltok, grammar_of(kind, next(iter(field.values()))), p,
                                        tok.eos_token_id, MAX_NEW)
        for shape in (dict(num_speculative_tokens=3), dict(tree={"branching": [2, 2]})):
            got, last = eagle3_stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW,
                                              structured_output=field, **shape)
            assert_same_or_near_tie(got, want, gaps, f"eagle3 {kind} {shape}")
            assert last.stats.method == "eagle3"
            for seed in range(3):
                _, last = eagle3_stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW, seed=seed,
                                                temperature=1.0, structured_output=field, **shape)
                assert last.finish_reason in ("stop", "length"), last


@torch.inference_mode()
def eagle3_joint(heads, prompt, params: SamplingParams, eps=1e-7) -> dict:
    """The law of 3 tokens if every draft were kept: token 1 from the target,
    tokens 2-3 from the head (the reference forward above)."""
    from safetensors.torch import load_file

    target = LlamaForCausalLM.from_pretrained(heads["target"], dtype=torch.float32)
    w = load_file(str(Path(heads["eagle3"]) / "model.safetensors"))
    embed, vocab = target.model.embed_tokens.weight, heads["vocab"]
    hs = hf_hidden_states(target, prompt)
    feats = list(torch.cat([hs[i][0] for i in AUX], -1))
    p1 = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1], params)
    joint = {}
    for x1 in torch.nonzero(p1 > eps).flatten().tolist():
        q2, f2 = ref_eagle3_probs(w, embed, prompt[1:] + [x1], feats, vocab)
        q2 = logits_to_probs(q2.log(), params)
        for x2 in torch.nonzero(q2 > eps).flatten().tolist():
            q3, _ = ref_eagle3_probs(w, embed, prompt[1:] + [x1, x2], feats + [f2], vocab)
            q3 = logits_to_probs(q3.log(), params)
            for x3 in torch.nonzero(q3 > eps).flatten().tolist():
                joint[(x1, x2, x3)] = float(p1[x1] * q2[x2] * q3[x3])
    return joint


def overlap(joint: dict, other: dict) -> float:
    """P(the first draft token is kept) if drafts followed `other`: the overlap
    of the two laws of the first two tokens."""
    def two(j):
        out: dict = {}
        for k, v in j.items():
            out[k[:2]] = out.get(k[:2], 0.0) + v
        return out
    a, b = two(joint), two(other)
    return sum(min(v, b.get(k, 0.0)) for k, v in a.items())


_FAVOURABLE: dict = {}


def favourable_prompt(heads) -> list[int]:
    """Of a few corpus prompts, the one where the head's drafts are kept most
    often at T = 1 / top-k 6 (the test needs both kept drafts and rejections
    to run; the law must hold whatever the prompt). Chosen once per module."""
    if "prompt" not in _FAVOURABLE:
        tok, params = load_tokenizer(heads["target"]), SamplingParams(1.0, 1.0, 6)
        scored = []
        for line in [l for l in corpus_lines(600) if len(l.strip()) > 20][:: 60][:8]:
            prompt = tok(line)["input_ids"][:6]
            joint, head = exact_joint(heads["target"], prompt, params), eagle3_joint(heads, prompt, params)
            scored.append((overlap(joint, head), prompt))
        _FAVOURABLE["prompt"] = max(scored)[1]
    return _FAVOURABLE["prompt"]


@pytest.mark.parametrize("temperature,top_p,top_k,draft", [
    (1.0, 1.0, 6, dict(num_speculative_tokens=2)),
    (0.7, 0.8, 0, dict(tree={"branching": [2, 2]})),
], ids=["chain-T1", "static22-T0.7p0.8"])
@pytest.mark.services
@pytest.mark.statistical
def test_eagle3_sampling_matches_target(temperature, top_p, top_k, draft, heads, eagle3_stack):
    params = SamplingParams(temperature, top_p, top_k)
    prompt = favourable_prompt(heads)
    joint, head = exact_joint(heads["target"], prompt, params), eagle3_joint(heads, prompt, params)
    threshold = null_threshold(joint, N)
    # Power: a rule that kept every draft would follow the head's law, which
    # this threshold must be able to tell from the target's.
    assert tv(joint, {k: v * N for k, v in head.items()}, N) > 2 * threshold
    check_stream_law(eagle3_stack, prompt, joint, threshold,
                     dict(temperature=temperature, top_p=top_p, top_k=top_k, **draft))

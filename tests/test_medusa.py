"""Published Medusa heads (method medusa), saved here in both published
layouts - the Medusa authors' (medusa_head.{i}.{j}.linear.*) and vLLM's
(blocks.{i}.layers.{j}.*, lm_heads.{i}, a truncated vocabulary with its
token_map) - with weights distilled for a few seconds on the tiny Llama
target's own greedy text, so that drafts are sometimes kept.

* The serving drafter's per-depth distributions equal a reference forward
  written below from Medusa's definition in plain torch: depth d is head d-1
  on the target's last hidden state after its final norm, whatever the
  tokens drafted before it;
* through the real services, greedy output equals target-only decoding
  (chains, a static tree from medusa_choices, a dynamic tree);
* heads whose hidden size or vocabulary do not fit the target are refused
  before anything starts, in one line naming the mismatch.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from drafter_svc.config import DrafterConfig
from drafter_svc.eagle import make_drafter
from orchestrator.pair import IncompatiblePair, check_pair
from orchestrator.spec_config import ConfigError, SpeculativeConfig
from specd.local_stack import Stack
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams, logits_to_probs, truncate_top
from specd_core.runtime.head_formats import head_format, head_method
from specd_core.runtime.medusa_format import load_medusa
from specd_core.runtime.models import load_model, load_tokenizer
from specd_core.runtime.propose_call import ProposeCall
from tests.test_greedy_exact import MAX_NEW, assert_same_or_near_tie, prompts, reference
from tests.tiny_models import corpus_lines
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

NUM_HEADS, NUM_LAYERS = 3, 1
DRAFT_VOCAB = 160  # the vLLM-layout head's truncated vocabulary


# ----- the heads, in both published layouts -----------------------------------------------


def self_distillation(target, tok, windows: int = 16, prompt_len: int = 8, new: int = 40):
    """The target's own greedy continuations of corpus windows, and its last
    hidden states over them (after its final norm)."""
    ids = torch.tensor(tok("\n".join(corpus_lines(400)))["input_ids"])
    starts = torch.linspace(0, len(ids) - prompt_len - 1, windows).long()
    x = torch.stack([ids[s : s + prompt_len] for s in starts])
    with torch.no_grad():
        seq = target.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )
        h = target(seq, output_hidden_states=True).hidden_states[-1]
    return seq, h


def trained_heads(target, tok, steps: int = 250) -> list[dict]:
    """Per head i: {"w": [W_j], "b": [b_j], "lm": lm} trained so that head i
    at position t predicts token t + 2 + i (Medusa's offsets)."""
    seq, h = self_distillation(target, tok)
    g = torch.Generator().manual_seed(3)
    hidden, lm0 = h.shape[-1], target.lm_head.weight.detach()
    heads = [
        {
            "w": [torch.randn(hidden, hidden, generator=g) * 0.02 for _ in range(NUM_LAYERS)],
            "b": [torch.zeros(hidden) for _ in range(NUM_LAYERS)],
            "lm": lm0.clone(),
        }
        for _ in range(NUM_HEADS)
    ]
    params = [t.requires_grad_() for hd in heads for t in (*hd["w"], *hd["b"], hd["lm"])]
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(steps):
        loss = sum(
            F.cross_entropy(ref_head(hd, h[:, : -(2 + i)]).flatten(0, 1), seq[:, 2 + i :].flatten())
            for i, hd in enumerate(heads)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [
        {k: ([t.detach() for t in v] if isinstance(v, list) else v.detach()) for k, v in hd.items()} for hd in heads
    ]


def save_original(out: Path, heads: list[dict], vocab: int, hidden: int, pt: bool = False, prefix="medusa_head."):
    """The Medusa authors' layout: medusa_lm_head.safetensors (or .pt, saved from the ModuleList: no prefix)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "medusa_num_heads": len(heads),
        "medusa_num_layers": NUM_LAYERS,
        "base_model_name_or_path": "tiny-llama",
        "hidden_size": hidden,
        "vocab_size": vocab,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    w = {}
    for i, hd in enumerate(heads):
        for j, (wt, b) in enumerate(zip(hd["w"], hd["b"])):
            w[f"{prefix}{i}.{j}.linear.weight"], w[f"{prefix}{i}.{j}.linear.bias"] = wt, b
        w[f"{prefix}{i}.{NUM_LAYERS}.weight"] = hd["lm"]
    w = {k: v.contiguous() for k, v in w.items()}
    if pt:
        torch.save(w, out / "medusa_lm_head.pt")
    else:
        save_file(w, str(out / "medusa_lm_head.safetensors"))
    return str(out)


def save_vllm(out: Path, heads: list[dict], vocab: int, hidden: int, token_map: torch.Tensor | None = None):
    """vLLM's layout; with token_map, each head's LM head keeps only those rows."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "num_heads": len(heads),
        "num_hidden_layers": NUM_LAYERS,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "medusa_fc_bias": True,
        "truncated_vocab_size": len(token_map) if token_map is not None else vocab,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    w = {}
    for i, hd in enumerate(heads):
        for j, (wt, b) in enumerate(zip(hd["w"], hd["b"])):
            w[f"blocks.{i}.layers.{j}.weight"], w[f"blocks.{i}.layers.{j}.bias"] = wt, b
        cut = token_map is not None and hd["lm"].shape[0] == vocab  # else already the draft rows
        w[f"lm_heads.{i}.weight"] = hd["lm"][token_map] if cut else hd["lm"]
    if token_map is not None:
        w["token_map"] = token_map
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    return str(out)


@pytest.fixture(scope="module")
def medusa(pairs, tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa-heads")
    target_dir = pairs["llama"][0]
    tok = load_tokenizer(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    torch.manual_seed(0)
    heads = trained_heads(target, tok)
    seq, _ = self_distillation(target, tok)
    # The truncated vocabulary: the tokens the target writes most, as vLLM's are chosen by frequency.
    counts = torch.bincount(seq.flatten(), minlength=vocab).float() + torch.rand(vocab) * 1e-3
    token_map = torch.sort(torch.topk(counts, DRAFT_VOCAB).indices).values
    return {
        "target": target_dir,
        "vocab": vocab,
        "hidden": hidden,
        "heads": heads,
        "token_map": token_map,
        "original": save_original(root / "original", heads, vocab, hidden),
        "vllm": save_vllm(root / "vllm", heads, vocab, hidden, token_map),
    }


# ----- the reference forward, from Medusa's definition --------------------------------------


def ref_head(hd: dict, x: torch.Tensor) -> torch.Tensor:
    """One head's logits: residual blocks x + SiLU(W x + b), then its LM head."""
    for wt, b in zip(hd["w"], hd["b"]):
        x = x + F.silu(x @ wt.T + b)
    return x @ hd["lm"].T


def ref_probs(medusa, feature: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """Per depth d = 1..K: head d-1's distribution over the target's ids."""
    out = []
    for hd in medusa["heads"]:
        if layout == "vllm":  # only the token_map rows exist; the rest get no mass
            full = torch.full((medusa["vocab"],), float("-inf"))
            full[medusa["token_map"]] = ref_head({**hd, "lm": hd["lm"][medusa["token_map"]]}, feature)
            out.append(full.softmax(-1))
        else:
            out.append(ref_head(hd, feature).softmax(-1))
    return out


def ref_rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# ----- unit -----------------------------------------------------------------------------------


@pytest.mark.unit
def test_both_layouts_are_read_as_medusa(medusa, tmp_path):
    for layout in ("original", "vllm"):
        assert head_format(medusa[layout]) == "medusa" and head_method(medusa[layout]) == "medusa"
    # A head file saved from the ModuleList itself (no prefix), as .pt.
    pt = save_original(tmp_path / "pt", medusa["heads"], medusa["vocab"], medusa["hidden"], pt=True, prefix="")
    w = load_medusa(pt, json.loads((Path(pt) / "config.json").read_text()))
    assert head_format(pt) == "medusa" and w.num_heads == NUM_HEADS and w.layout == "original"
    assert torch.equal(w.lm_heads[1], medusa["heads"][1]["lm"]) and torch.equal(
        w.residual[2][0][1], medusa["heads"][2]["b"][0]
    )


@pytest.mark.unit
@torch.inference_mode()
@pytest.mark.parametrize("layout", ["original", "vllm"])
def test_drafter_distributions_equal_reference_heads(medusa, layout):
    target_dir = medusa["target"]
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    prompt, first = [40, 41, 42, 43, 44, 45], 17
    v = Verifier(VerifierConfig(target_dir, device="cpu"))
    _, wire = v.open_session("s", prompt, SamplingParams(0.0), hidden=True)  # before the final norm
    feature = ref_rms(wire.decode()[-1], target.model.norm.weight, target.config.rms_norm_eps)
    want = ref_probs(medusa, feature, layout)

    d = make_drafter(DrafterConfig(medusa[layout], target_dir=target_dir, device="cpu", engine="lean"))
    assert d.method.name == "medusa" and d.vocab_size == medusa["vocab"]
    # The sessions take no KV blocks, but the replica's pool is still sized
    # from a budget in bytes: a row priced at a feature's bytes, not at 1 byte
    # (which made a 10 GiB budget a free list of 168 million blocks).
    assert d.runner.kv_pool.row_bytes >= d.runner.hidden_size, d.runner.kv_pool.row_bytes
    runner, s = d.runner, d.runner.new_session()
    got = [runner.feed_batch([(s, prompt[1:] + [first], wire.decode())])[0][-1].softmax(-1)]
    for _ in range(NUM_HEADS - 1):  # along a chain: whatever the token, depth d reads head d-1
        got.append(runner.forward_batch([(s, [int(got[-1].argmin())], None, None)])[0][-1].softmax(-1))
    for q, p in zip(got, want):
        assert torch.allclose(q, p, atol=1e-5), (q - p).abs().max()

    # Propose: a greedy chain of 4 is cut to the 3 heads, each token its head's first choice.
    d.open_session("c", prompt, SamplingParams(0.0))
    chain = d.propose(ProposeCall("c", [], [first], DraftShape.chain(4), hidden=wire)).tree
    assert chain.tokens == [int(p.argmax()) for p in want]
    # A static tree (medusa_choices): child k of a depth-d node is head d's k-th choice.
    d.open_session("t", prompt, SamplingParams(0.0))
    paths = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    tree = d.propose(ProposeCall("t", [], [first], DraftShape(paths=paths), hidden=wire)).tree
    ranks = [torch.topk(p, 2).indices.tolist() for p in want]
    assert tree.tokens == [ranks[len(p) - 1][p[-1]] for p in paths]
    # Sampled: every row's q is its depth's head under the session's law, truncated as sent.
    params = SamplingParams(0.8, top_p=0.95, seed=4)
    d.open_session("q", prompt, params)
    prop = d.propose(ProposeCall("q", [], [first], DraftShape(branching=(2, 2)), hidden=wire)).tree
    for row, (ids, probs) in enumerate(prop.row_dists):
        if not ids:
            continue
        depth = 0 if row == 0 else 1  # the root's children are depth 1 (head 0), theirs depth 2 (head 1)
        logits = torch.log(want[depth])
        ref_ids, ref_q = truncate_top(logits_to_probs(logits, params), d.config.draft_top_n)
        assert ids == ref_ids.tolist() and torch.allclose(torch.tensor(probs), ref_q.float(), atol=1e-5)


@pytest.mark.unit
def test_heads_that_do_not_fit_are_refused_naming_the_mismatch(medusa, tmp_path):
    target, vocab, hidden = medusa["target"], medusa["vocab"], medusa["hidden"]
    small = [{"w": [torch.zeros(32, 32)], "b": [torch.zeros(32)], "lm": torch.zeros(vocab, 32)}]
    wide = [{**medusa["heads"][0], "lm": torch.zeros(vocab + 8, hidden)}]
    bad = {
        "hidden_size 32": save_original(tmp_path / "h", small, vocab, 32),
        f"vocab_size {vocab + 8}": save_vllm(tmp_path / "v", wide, vocab + 8, hidden),
        "token_map maps draft rows outside": save_vllm(
            tmp_path / "m",
            [{**medusa["heads"][0], "lm": torch.zeros(8, hidden)}],
            vocab,
            hidden,
            torch.arange(vocab - 4, vocab + 4),
        ),
    }
    # A config naming more heads than the weights hold.
    short = Path(save_original(tmp_path / "s", medusa["heads"][:2], vocab, hidden))
    (short / "config.json").write_text(
        json.dumps({**json.loads((short / "config.json").read_text()), "medusa_num_heads": 3})
    )
    bad["the weights have no medusa_head.2.0.linear.weight"] = str(short)
    for needle, head in bad.items():
        with pytest.raises(IncompatiblePair) as e:
            check_pair(target, head)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert str(e.value).startswith("medusa head")
        with pytest.raises(ValueError, match="does not fit"):
            make_drafter(DrafterConfig(head, target_dir=target, device="cpu"))
        with pytest.raises(IncompatiblePair, match="does not fit"):
            Stack(target, head)  # before anything starts
    check_pair(target, medusa["original"])
    check_pair(target, medusa["vllm"])


@pytest.mark.unit
def test_medusa_choices_are_the_tree():
    sc = SpeculativeConfig.from_dict({"method": "medusa", "medusa_choices": [[0], [1], [0, 0]]})
    assert sc.tree_shape() == DraftShape(paths=((0,), (1,), (0, 0)))
    with pytest.raises(ConfigError, match="medusa_choices"):
        SpeculativeConfig.from_dict({"method": "medusa", "medusa_choices": [[0]], "tree": {"branching": [2]}})


@pytest.mark.unit
def test_specd_up_with_method_medusa(medusa, tmp_path, monkeypatch, up_without_ray, capsys):
    """`specd up --method medusa --drafter HEADS`: heads that do not fit are
    refused before Ray starts, in one line; none given is refused (there is
    no demo Medusa head); heads that fit go on to Ray."""
    from specd.cli import deploy
    from specd.cli.parser import build_parser

    deployed = up_without_ray
    small = [{"w": [torch.zeros(32, 32)], "b": [torch.zeros(32)], "lm": torch.zeros(medusa["vocab"], 32)}]
    bad = save_original(tmp_path / "bad", small, medusa["vocab"], 32)
    up = ["up", "--target", medusa["target"], "--method", "medusa"]
    assert deploy.cmd_up(build_parser().parse_args([*up, "--drafter", bad])) == 2 and not deployed
    err = capsys.readouterr().err.strip()
    assert err.startswith("specd up: medusa head") and "hidden_size 32" in err and "\n" not in err
    assert deploy.cmd_up(build_parser().parse_args(up)) == 2 and not deployed
    assert "method medusa needs Medusa heads" in capsys.readouterr().err
    monkeypatch.setattr(deploy, "_with_models", lambda cfg, models: cfg)
    assert deploy.cmd_up(build_parser().parse_args([*up, "--drafter", medusa["vllm"]])) == 1 and deployed


# ----- services: greedy exactness ---------------------------------------------------------------


SHAPES = [
    {"num_speculative_tokens": 1},
    {"num_speculative_tokens": 3},
    {},  # {}: the service's medusa_choices
    {"tree": {"node_budget": 6, "max_depth": 3, "top_k": 2}},
]


@pytest.fixture(scope="module")
def original_stack(medusa):
    stack = Stack(
        medusa["target"],
        medusa["original"],
        orchestrator_args=("--method", "medusa", "--tree-paths", "0;1;0,0;0,1;0,0,0"),
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def vllm_stack(medusa, tmp_path_factory):
    spec = tmp_path_factory.mktemp("spec") / "speculative.json"
    spec.write_text(
        json.dumps(
            {
                "method": "medusa",
                "model": medusa["vllm"],
                "num_speculative_tokens": 3,
                "medusa_choices": [[0], [1], [0, 0], [2], [0, 0, 0]],
            }
        )
    )
    stack = Stack(medusa["target"], medusa["vllm"], orchestrator_args=("--speculative-config", str(spec)))
    yield stack
    stack.stop()


def _greedy_equals_target(stack, medusa, n_prompts: int) -> None:
    model, tok = load_model(medusa["target"], "cpu"), load_tokenizer(medusa["target"])
    accepted = drafted = 0
    for p in prompts(tok, n_prompts):
        want, gaps = reference(model, p)
        for shape in SHAPES:
            got, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW, **shape)
            assert_same_or_near_tie(got, want, gaps, f"medusa {shape}")
            s = last.stats
            assert s.method == "medusa" and s.drafted_tokens > 0
            accepted, drafted = accepted + s.accepted_tokens, drafted + s.drafted_tokens
    print(f"medusa greedy: accepted {accepted} of {drafted} drafted")
    assert 0 < accepted < drafted  # both paths ran: kept drafts and rejections


@pytest.mark.services
def test_original_layout_greedy_equals_target_only(medusa, original_stack):
    _greedy_equals_target(original_stack, medusa, 3)


@pytest.mark.services
def test_vllm_layout_greedy_equals_target_only(medusa, vllm_stack):
    _greedy_equals_target(vllm_stack, medusa, 2)


@pytest.mark.services
def test_status_says_what_each_drafter_drafts_with(medusa, original_stack, vllm_stack, capsys):
    """`specd status` names the heads, their layout and, for vLLM's layout, the
    truncated draft vocabulary against the target's."""
    from specd.cli import main

    for stack, want in (
        (original_stack, f"medusa: {NUM_HEADS} published Medusa heads (original layout)\n"),
        (vllm_stack, f"medusa: {NUM_HEADS} published Medusa heads (vllm layout), draft vocabulary {DRAFT_VOCAB} "
                     f"of the target's {medusa['vocab']}\n"),
    ):
        assert main(["status", "--address", stack.orchestrator.address]) == 0
        assert f"drafter-0 drafts with {want}" in capsys.readouterr().out


# ----- services: the sampling law -------------------------------------------------------------


@torch.inference_mode()
def medusa_joint(medusa, prompt: list[int], params: SamplingParams, layout: str, eps=1e-7) -> dict:
    """The law of 3 tokens if every draft were kept: token 1 from the target's
    prefill, tokens 2 and 3 from heads 0 and 1 on the last prompt row's
    feature (the reference forward above), under the request's law."""
    target = LlamaForCausalLM.from_pretrained(medusa["target"], dtype=torch.float32)
    out = target(torch.tensor([prompt]), output_hidden_states=True)
    feature = out.hidden_states[-1][0, -1]  # after the final norm, as the heads read it
    p1 = logits_to_probs(out.logits[0, -1], params)
    q2, q3 = (logits_to_probs(torch.log(q), params) for q in ref_probs(medusa, feature, layout)[:2])
    s1, s2, s3 = (torch.nonzero(p > eps).flatten().tolist() for p in (p1, q2, q3))
    return {(a, b, c): float(p1[a] * q2[b] * q3[c]) for a in s1 for b in s2 for c in s3}


_FAVOURABLE: dict = {}


def favourable_prompt(medusa) -> list[int]:
    """Of a few corpus prompts, the one where the heads' drafts are kept most
    often at T = 1 / top-k 6 (the test needs kept drafts and rejections both;
    the law must hold whatever the prompt). Chosen once per module."""
    from tests.test_eagle3 import overlap
    from tests.test_sampling_lossless import exact_joint

    if "prompt" not in _FAVOURABLE:
        tok, params = load_tokenizer(medusa["target"]), SamplingParams(1.0, 1.0, 6)
        scored = []
        for line in [ln for ln in corpus_lines(600) if len(ln.strip()) > 20][::60][:8]:
            prompt = tok(line)["input_ids"][:6]
            joint = exact_joint(medusa["target"], prompt, params)
            scored.append((overlap(joint, medusa_joint(medusa, prompt, params, "original")), prompt))
        _FAVOURABLE["prompt"] = max(scored)[1]
    return _FAVOURABLE["prompt"]


@pytest.mark.parametrize("layout,temperature,top_p,top_k,draft", [
    ("original", 1.0, 1.0, 6, dict(num_speculative_tokens=2)),
    ("vllm", 0.7, 0.8, 0, dict(tree={"branching": [2, 2]})),
], ids=["original-chain-T1", "vllm-static22-T0.7p0.8"])
@pytest.mark.services
@pytest.mark.statistical
def test_medusa_sampling_matches_target(layout, temperature, top_p, top_k, draft, medusa, original_stack, vllm_stack):
    """Sampled requests drafted by Medusa heads follow the target's exact law
    (the joint of their first 3 tokens over N seeds within the threshold),
    with kept drafts and rejections both run; a rule that kept every draft
    would follow the heads' law, which the threshold tells apart."""
    from tests.test_sampling_lossless import N, check_stream_law, exact_joint, null_threshold, tv

    params = SamplingParams(temperature, top_p, top_k)
    prompt = favourable_prompt(medusa)
    joint = exact_joint(medusa["target"], prompt, params)
    threshold = null_threshold(joint, N)
    heads = medusa_joint(medusa, prompt, params, layout)
    assert tv(joint, {k: v * N for k, v in heads.items()}, N) > 2 * threshold
    stack = original_stack if layout == "original" else vllm_stack
    check_stream_law(stack, prompt, joint, threshold, dict(temperature=temperature, top_p=top_p, top_k=top_k, **draft))

"""The lean engine (specd_core/runtime/lean.py) against Hugging Face's own forward, in fp32,
for every family tests/tiny_models.py builds (each RoPE variant, sliding windows,
Gemma's quirks, Phi-3's fused weights, tied and untied embeddings): prefill, decode
steps and chunks after cached rows; token trees as the verifier builds them, past the
window; compaction; hidden states; batching; and which engine a Runner picks.

The oracle for a row is HF's logits of the linear sequence that row stands for (for a
tree node: prefix + its path), which is right for every family, sliding windows
included. Each model is saved by build_model and loaded by load_model, as a user's
checkpoint would be."""

import copy

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from specd_core.rules.tree import TokenTree, path_to
from specd_core.runtime.lean import LeanModel, supports, unsupported_reason
from specd_core.runtime.models import Runner, SessionCache, load_model
from specd_core.runtime.tree_tensors import tree_attention
from tests.tiny_models import FAMILIES, build_model, build_tokenizer

pytestmark = pytest.mark.unit

ATOL = 2e-4
PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]  # 40 tokens: past every window of 8 or 31
# A tree below the root whose first branch is 10 deep (more rows than a window of 8),
# with side branches: parents come first.
TREE = TokenTree(
    tokens=(11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24),
    parents=(-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, -1, 10, 1, 12),
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> loaded target (built on first use)."""
    root = tmp_path_factory.mktemp("families")
    tok = build_tokenizer(root / "tokenizer")
    cache: dict = {}

    def get(family: str, size: str = "target"):
        if (family, size) not in cache:
            path = build_model(root / f"{family}-{size}", family, size, 1 if size == "target" else 2, tok,
                               15.0 if size == "target" else 30.0, random_norms=True)
            cache[family, size] = load_model(path, "cpu")
        return cache[family, size]

    return get


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and torch.allclose(a, b, atol=ATOL), (a - b).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["target", "drafter"])
def test_prefill_decode_and_chunks_match_hf(family, size, models):
    """A prefill, decode steps, then a chunk of rows after cached ones: each
    row's logits are HF's for the sequence up to it (48 rows: within Phi-3.5's
    short-factor range, past every sliding window)."""
    model = models(family, size)
    assert supports(model.config), unsupported_reason(model.config)
    s = LeanModel(model).new_session()
    s.INITIAL_ROWS = 4
    steps = [PROMPT, [7], [8], [9], [10, 11, 12, 13, 14]]
    got = torch.cat([s.forward(ids) for ids in steps])
    close(got, hf_logits(model, [t for ids in steps for t in ids]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("form", ["dense", "tree"])
def test_tree_rows_equal_their_paths(family, form, models):
    """A verifier's tree forward after 30 cached rows, the tree given as
    tree_attention's mask and positions (dense) or as the TokenTree itself,
    whose mask the step builds: row 0 (the root) and each node's row are HF's
    last logits for prefix + root + the node's path - 10 rows deep, past a
    window of 8. Then compaction to one path and a continuation: HF on the
    committed sequence."""
    model = models(family)
    s = LeanModel(model).new_session()
    prefix, root = PROMPT[:30], 4
    s.forward(prefix)
    if form == "dense":
        mask, pos = tree_attention(TREE, len(prefix))
        rows = s.forward([root] + list(TREE.tokens), positions=pos[0], mask=mask[0, 0])
    else:
        rows = s.forward([root] + list(TREE.tokens), mask=TREE)
    close(rows[0], hf_logits(model, prefix + [root])[-1])
    for node in range(len(TREE.tokens)):
        path = [TREE.tokens[n] for n in path_to(TREE, node)]
        close(rows[node + 1], hf_logits(model, prefix + [root] + path)[-1])
    kept = path_to(TREE, 9)  # the deep branch
    s.compact(len(prefix), [0] + [n + 1 for n in kept])
    more = [30, 31, 32]
    committed = prefix + [root] + [TREE.tokens[n] for n in kept]
    close(s.forward(more), hf_logits(model, committed + more)[-3:])


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_are_hf_last_layer_before_the_final_norm(family, models):
    """forward_batch(hidden=True) returns what enters HF's final norm (in
    transformers 5.24 output_hidden_states[-1] is the normed output, so the
    oracle is read with a hook on the norm's input)."""
    model = models(family)
    s = LeanModel(model).new_session()
    seen = {}

    def keep(module, args):  # returns None: the input goes on unchanged
        seen["x"] = args[0][0]

    hook = model.model.norm.register_forward_pre_hook(keep)
    try:
        hf_logits(model, PROMPT)
    finally:
        hook.remove()
    states = [s.lean.forward_batch([(s, ids, None, None)], hidden=True)[1][0] for ids in (PROMPT[:25], PROMPT[25:])]
    close(torch.cat(states).float(), seen["x"].float())


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_sessions_equal_each_alone(family, models):
    """forward_batch over 3 sessions at different lengths (a prefill, a decode
    step past the window, a tree) gives each its own forward's logits and cache."""
    lean = LeanModel(models(family))
    solo = [lean.new_session() for _ in range(3)]
    batched = [lean.new_session() for _ in range(3)]
    for group in (solo, batched):
        group[1].forward(PROMPT[:35])
        group[2].forward(PROMPT[:20])
    small = TokenTree(tokens=(40, 41, 42, 43), parents=(-1, 0, -1, 2))
    mask, pos = tree_attention(small, 20)
    work = [(PROMPT[:12], None, None), ([9], None, None), ([5] + list(small.tokens), pos[0], mask[0, 0])]
    want = [s.forward(ids, positions=p, mask=m) for s, (ids, p, m) in zip(solo, work)]
    got = lean.forward_batch([(s, ids, p, m) for s, (ids, p, m) in zip(batched, work)])
    for w, g in zip(want, got):
        close(g, w)
    for a, b in zip(solo, batched):
        assert a.length == b.length
        close(b.forward([3, 4]), a.forward([3, 4]))


def fresh_rope(model) -> None:
    """HF's dynamic and longrope frequencies are state of the model's rotary
    module (the largest length seen, shared by every call): start from scratch."""
    model.model.rotary_emb.__init__(model.config)


@pytest.mark.parametrize(
    "family, switch, prompt, steps",
    [
        # Phi-3.5's longrope switches to the long factors past 48 positions.
        ("phi3.5", 48, 40, 12),
        # Dynamic NTK recomputes its frequencies past max_position_embeddings (256).
        ("llama-dynamic", 256, 250, 10),
    ],
)
def test_length_dependent_rope_equals_plain_decoding(family, switch, prompt, steps, models):
    """Past the length where the frequencies change, HF's logits depend on how
    a sequence is split into calls; specd must give what the target alone
    gives in plain decoding (a prefill, then one token per call). Here the
    lean engine runs a prefill, then verify-sized chunks and a tree, and every
    row equals HF's plain decoding of that row's own sequence (a tree node's:
    the committed tokens, then its path)."""
    model = models(family)
    ids = [(5 * i + 1) % 300 + 3 for i in range(prompt + steps + 4)]

    def plain(seq: list[int]) -> torch.Tensor:
        """HF's logits after each token of seq past the prompt, decoding one at a time."""
        fresh_rope(model)
        hf = SessionCache(model)
        rows = [hf.forward(seq[:prompt])[-1:]] + [hf.forward([t]) for t in seq[prompt:]]
        return torch.cat(rows)

    lean = LeanModel(model).new_session(max_len=512)
    got = [lean.forward(ids[:prompt])[-1:]]
    got += [lean.forward(ids[i : i + 5]) for i in range(prompt, len(ids), 5)]
    close(torch.cat(got), plain(ids))
    # A tree on top (its own positions and mask, as the verifier's): each node's
    # row is plain decoding along its path.
    lean.rollback(len(ids) - 1)  # the last committed token is the tree's root row, as in a verify
    small = TokenTree(tokens=(40, 41, 42, 43), parents=(-1, 0, 1, -1))
    mask, pos = tree_attention(small, len(ids) - 1)
    rows = lean.forward([ids[-1]] + list(small.tokens), positions=pos[0], mask=mask[0, 0])
    paths = {0: [40], 1: [40, 41], 2: [40, 41, 42], 3: [43]}
    for node, path in paths.items():
        close(rows[node + 1], plain(ids + path)[-1])
    close(rows[0], plain(ids)[-1])
    # One prefill of the whole sequence equals HF's (a prefill is one call in both).
    fresh_rope(model)
    close(LeanModel(model).new_session(max_len=512).forward(ids), hf_logits(model, ids))
    # The switch matters: past it, the split into calls changes HF's logits.
    fresh_rope(model)
    assert not torch.allclose(hf_logits(model, ids)[-1], plain(ids)[-1], atol=1e-3)


@pytest.mark.parametrize("family", ["mistral", "phi3", "gemma2", "gemma3"])
def test_the_windows_matter_here(family, models):
    """The sliding windows of these models change the logits at PROMPT's length,
    so the tests above would catch a window ignored."""
    model = models(family)
    want = hf_logits(model, PROMPT)
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = 10**6
    for layer in unwindowed.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 10**6
    assert not torch.allclose(want[-1], hf_logits(unwindowed, PROMPT)[-1], atol=1e-3)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_hf_fallback_rolls_back_past_a_window(family, models):
    """The Hugging Face engine (SessionCache) on a sliding-window model: a
    rollback after the window was passed, then chunks and steps, equal HF's
    forward of the sequence (its cache keeps every row, not just the window)."""
    model = models(family)
    s = SessionCache(model)
    s.forward(PROMPT[:20])
    s.rollback(15)
    got = torch.cat([s.forward(PROMPT[15:30])] + [s.forward([t]) for t in PROMPT[30:40]])
    close(got, hf_logits(model, PROMPT)[15:40])


@pytest.mark.parametrize("family", FAMILIES)
def test_runner_runs_every_family_lean(family, models):
    assert Runner(models(family)).engine == "lean"


def _tiny_llama(**rope) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        rope_parameters={"rope_theta": 10000.0, **rope}))


def test_configs_it_does_not_cover_fall_back_to_hf(models):
    from transformers import GPT2LMHeadModel

    gemma3 = copy.deepcopy(models("gemma3").config)
    gemma3.attn_logit_softcapping = 50.0
    bidirectional = copy.deepcopy(models("gemma3").config)
    bidirectional.use_bidirectional_attention = True
    others = [
        GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)),
        MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         num_local_experts=2)),
        _tiny_llama(rope_type="proportional", factor=2.0),  # a RoPE type the lean engine does not know
    ]
    for model in others:
        assert Runner(model).engine == "hf", model.config.model_type
        with pytest.raises(ValueError, match="does not"):
            Runner(model, "lean")
    for config in (gemma3, bidirectional):
        assert not supports(config) and unsupported_reason(config)
    assert "rope_type 'proportional'" in unsupported_reason(others[2].config)

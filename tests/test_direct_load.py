"""The lean engine's direct load (specd_core/runtime/lean_load.py) against the
LeanModel built from a Hugging Face model: the same logits, bit for bit, for
every family tests/tiny_models.py builds (targets and drafters: tied and untied
embeddings, biases, fused weights, each RoPE variant, past the RoPE switch of
the sequence-dependent ones), in fp32 and bf16, padded vocabularies and sharded
checkpoints; and the checkpoints it leaves to the HF path (load_lean -> None)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.configuration_utils import PreTrainedConfig

from specd_core.runtime.arch import describe
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.lean_load import COMMON_KEYS, FAMILY_KEYS, load_checkpoint, load_lean, read_config
from specd_core.runtime.models import Runner, architecture, context_length, load_model, vocab_size
from tests.tiny_models import FAMILIES, build_model, build_tokenizer

# 60 tokens: past every sliding window (8, 31) and past Phi-3.5's longrope switch (48).
PROMPTS = ([(7 * i + 3) % 300 + 5 for i in range(60)], [5, 9, 300, 2], [42])
STEPS = ([11], [12, 13, 14], [15])  # decode steps and a chunk after the prefill


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct")
    return root, build_tokenizer(root / "tokenizer")


def build(tok_dir, family: str, size: str, **kw) -> str:
    root, tok = tok_dir
    name = "-".join([family, size, *(f"{k}{v}" for k, v in kw.items())])
    return build_model(root / name, family, size, 1 if size == "target" else 2, tok, 15.0, random_norms=True, **kw)


def run(lm: LeanModel, prompt: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill then decode steps, one session (room past the context for dynamic NTK)."""
    s = lm.new_session(max_len=4 * lm.max_positions)
    return [s.forward(ids) for ids in (prompt, *STEPS)]


def assert_same(path: str, dtype: str = "default") -> None:
    old = LeanModel(load_model(path, "cpu", dtype))
    new = load_lean(path, "cpu", dtype)
    assert new is not None
    assert new.dtype == old.dtype and new.vocab_size == old.vocab_size
    for prompt in PROMPTS:
        for a, b in zip(run(old, prompt), run(new, prompt)):
            assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.unit
@pytest.mark.parametrize("size", ["target", "drafter"])
@pytest.mark.parametrize("family", FAMILIES)
def test_same_logits(tok_dir, family, size):
    assert_same(build(tok_dir, family, size))


@pytest.mark.unit
@pytest.mark.parametrize("family", ["llama-dynamic", "phi3.5"])
def test_past_the_rope_switch(tok_dir, family):
    # A context of 32: the 60-token prompt passes dynamic NTK's max_position_embeddings
    # (Phi-3.5's longrope switch, 48, is fixed by its config and crossed anyway).
    assert_same(build(tok_dir, family, "target", context=32))


@pytest.mark.unit
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3.5"])
def test_half_precision(tok_dir, family):
    assert_same(build(tok_dir, family, "target"), "bfloat16")


@pytest.mark.unit
def test_checkpoint_dtype(tok_dir):
    """dtype "auto" reads the checkpoint's own (float16 here) as the HF path does."""
    path = build(tok_dir, "qwen2", "drafter")
    model = load_model(path, "cpu", "float16")
    model.save_pretrained(path + "-fp16")
    assert_same(path + "-fp16", "auto")
    assert load_lean(path + "-fp16", "cpu", "auto").dtype == torch.float16


@pytest.mark.unit
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_padded_vocabulary(tok_dir, family):
    assert_same(build(tok_dir, family, "target", rows=400))


@pytest.mark.unit
def test_sharded(tok_dir):
    path = build(tok_dir, "mistral", "target")
    load_model(path, "cpu").save_pretrained(path + "-sharded", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(path + "-sharded", "model.safetensors.index.json"))
    assert_same(path + "-sharded")


def _rewrite(src: str, dst: str, edit) -> str:
    """A copy of checkpoint src whose tensors are edit(tensors)."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    save_file(edit(load_file(os.path.join(src, "model.safetensors"))), os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.unit
def test_left_to_hf(tok_dir):
    """Checkpoints the direct path does not reproduce: None, for the HF path to load."""
    path = build(tok_dir, "llama", "drafter")
    no_head = _rewrite(path, path + "-nohead", lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"})
    assert load_lean(no_head, "cpu") is None  # untied, no output layer: HF initialises one randomly
    renamed = _rewrite(path, path + "-renamed", lambda w: {"transformer." + k: v for k, v in w.items()})
    assert load_lean(renamed, "cpu") is None  # a layout HF would have to rename
    no_norm = _rewrite(path, path + "-nonorm", lambda w: {k: v for k, v in w.items() if k != "model.norm.weight"})
    assert load_lean(no_norm, "cpu") is None
    bin_only = _rewrite(path, path + "-noweights", lambda w: w)
    os.remove(os.path.join(bin_only, "model.safetensors"))
    assert load_lean(bin_only, "cpu") is None  # no safetensors weights (e.g. only pytorch_model.bin)
    tied = build(tok_dir, "qwen3", "drafter")
    no_qnorm = _rewrite(tied, tied + "-noqnorm", lambda w: {k: v for k, v in w.items() if "q_norm" not in k})
    assert load_lean(no_qnorm, "cpu") is None  # the lean engine would skip the norm, HF would initialise it
    other = _rewrite(tied, tied + "-otherhead", lambda w: {**w, "lm_head.weight": w["model.embed_tokens.weight"] + 1})
    assert load_lean(other, "cpu") is None  # tied, but a different output layer stored too
    gpt2 = build(tok_dir, "gpt2", "drafter")
    assert load_lean(gpt2, "cpu") is None  # not a lean family


@pytest.mark.unit
@pytest.mark.parametrize("family", FAMILIES)
def test_config_without_its_class(tok_dir, family):
    """A config.json saved by transformers 5 is read as a plain PreTrainedConfig
    (not its family's class: that import is the cost), with the same fields."""
    path = build(tok_dir, family, "drafter")
    fast, full = read_config(path), AutoConfig.from_pretrained(path)
    assert type(fast) is PreTrainedConfig and type(full) is not PreTrainedConfig
    for key in (*COMMON_KEYS, *FAMILY_KEYS[full.model_type], "head_dim"):
        assert getattr(fast, key, None) == getattr(full, key, None), key
    assert describe(fast) == describe(full)


@pytest.mark.unit
def test_legacy_config(tok_dir):
    """A config in the transformers 4 form (rope_theta and rope_scaling, no
    head_dim) goes through AutoConfig, whose class converts it."""
    path = build(tok_dir, "llama3", "target")
    legacy = _rewrite(path, path + "-legacy", lambda w: w)
    with open(os.path.join(legacy, "config.json")) as f:
        d = json.load(f)
    rope = d.pop("rope_parameters")
    d.pop("head_dim")
    d.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, transformers_version="4.46.0")
    with open(os.path.join(legacy, "config.json"), "w") as f:
        json.dump(d, f)
    assert type(read_config(legacy)) is not PreTrainedConfig
    assert_same(legacy)


@pytest.mark.unit
def test_checkpoint_as_model(tok_dir):
    """What ModelCore reads of its model is the same on a Checkpoint, and a Runner runs it on the lean engine."""
    path = build(tok_dir, "gemma2", "target", rows=400)
    hf, ckpt = load_model(path, "cpu"), load_checkpoint(path, "cpu")
    assert vocab_size(ckpt) == vocab_size(hf) == 400
    assert context_length(ckpt.config) == context_length(hf.config)
    assert architecture(ckpt.config) == architecture(hf.config)
    assert (ckpt.device, ckpt.dtype) == (hf.device, hf.dtype)
    assert ckpt.config.eos_token_id == hf.config.eos_token_id
    runner = Runner(ckpt, "auto")
    assert runner.engine == "lean"
    with pytest.raises(ValueError):
        Runner(ckpt, "hf")  # no HF forward to fall back on


def _configs():
    """Configs saved by transformers 5 whose class normalises fields on load:
    Qwen2's use_sliding_window and max_window_layers, Gemma-3's and Phi-3's defaults."""
    from transformers import Gemma3TextConfig, Phi3Config, Qwen2Config

    return {
        "qwen2-sliding": Qwen2Config(
            use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=3
        ),
        "qwen2-unused-window": Qwen2Config(use_sliding_window=False, sliding_window=4096, num_hidden_layers=3),
        "gemma3-defaults": Gemma3TextConfig(num_hidden_layers=7),
        "phi3-defaults": Phi3Config(num_hidden_layers=2),
    }


@pytest.mark.unit
@pytest.mark.parametrize("name", list(_configs()))
def test_normalised_configs(tmp_path, name):
    _configs()[name].save_pretrained(tmp_path)
    fast, full = read_config(str(tmp_path)), AutoConfig.from_pretrained(tmp_path)
    assert type(fast) is PreTrainedConfig
    assert describe(fast) == describe(full)
    for key in (*COMMON_KEYS, *FAMILY_KEYS[full.model_type], "head_dim"):
        assert getattr(fast, key, None) == getattr(full, key, None), key

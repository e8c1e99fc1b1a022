"""Tiny random-initialised HF models with a real tokenizer, saved to a directory
and loaded back like a user's checkpoint. No hub access needed.

Every family in FAMILIES shares one byte-level BPE tokenizer; each has a
"target" and a differently seeded, smaller "drafter", so draft and target
distributions really differ. The families beyond Llama and Qwen2 take the
fields of a published config, shrunk (named beside each), with the quirks that
make the family what it is: RoPE variants, sliding windows small enough that
a test of 40+ tokens crosses them, q/k norms, a head_dim that is not
hidden/heads, fused weights, soft-capping, tied embeddings.
`build_chat_tokenizer` saves a separate tokenizer with a real family's chat
template, for chat models built on it; `build_char_tokenizer` a
character-level one with a decoder the grammar engine cannot read.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 384
EOS = "<|endoftext|>"
# Every family build_model makes for the lean engine (gpt2 too exists, for the
# Hugging Face fallback).
FAMILIES = ("llama", "qwen2", "llama3", "llama-linear", "llama-dynamic", "llama-yarn", "mistral", "qwen3",
            "phi3", "phi3.5", "gemma2", "gemma3")
# Families whose models keep HF's initial norm weights (all ones) unless asked:
# the models other tests were tuned on stay as they were.
PLAIN_NORMS = ("llama", "qwen2", "gpt2")


def corpus_lines(limit: int = 4000) -> list[str]:
    """A little Python source from the stdlib: present on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in ("functools.py", "textwrap.py", "json/decoder.py", "string.py"):
        lines += (stdlib / name).read_text().splitlines()
    return lines[:limit]


def build_tokenizer(out_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)
    fast.save_pretrained(out_dir)
    return fast


CHAR_EOS, CHAR_UNK = "<eos>", "<unk>"


def build_char_tokenizer(out_dir: str | os.PathLike, clean_up: bool = False) -> PreTrainedTokenizerFast:
    """A character-level WordLevel tokenizer whose decoder is a plain `Fuse`:
    one token per printable ASCII character (and newline), the two special
    tokens first. llguidance cannot read its decoder; specd derives its
    tokens' bytes (specd_core/runtime/token_text.py). clean_up: transformers'
    clean_up_tokenization_spaces on (" ." decodes as "."), which no per-token
    bytes can describe."""
    vocab = {CHAR_EOS: 0, CHAR_UNK: 1}
    for c in "\n" + "".join(chr(i) for i in range(32, 127)):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=CHAR_UNK))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=CHAR_EOS, unk_token=CHAR_UNK,
                                   clean_up_tokenization_spaces=clean_up)
    fast.save_pretrained(out_dir)
    return fast


BOS = "<s>"
CHATML_MARKERS = ["<|im_start|>", "<|im_end|>"]
# The ChatML template as Nous-Hermes-2-Mistral ships it (BOS text first, then
# <|im_start|>role\ncontent<|im_end|> per message), plus a role check the way
# Mistral's template refuses what it cannot render (raise_exception).
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_chat_tokenizer(out_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Like build_tokenizer (same VOCAB: the special tokens are trained in, not
    added after), with the ChatML markers as special tokens, the ChatML chat
    template, and a BOS that plain tokenisation adds (as Llama and Mistral
    tokenizers do): so a template that writes the BOS text gives a second BOS
    when its text is tokenised with special tokens, the mistake to guard against."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS, BOS, *CHATML_MARKERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS,
                                   additional_special_tokens=CHATML_MARKERS)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _config(family: str, size: str, vocab: int, eos_id: int, context: int = 256):
    """(config, model class) of a tiny model of `family`; size "target" or "drafter"."""
    hidden, layers = (64, 2) if size == "target" else (32, 1)
    small = size != "target"
    common = dict(vocab_size=vocab, eos_token_id=eos_id, bos_token_id=eos_id)
    shape = dict(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2)
    untied = dict(tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**shape, max_position_embeddings=context, **untied, **common), LlamaForCausalLM
    if family == "qwen2":
        return Qwen2Config(**shape, max_position_embeddings=256, **untied, **common), Qwen2ForCausalLM
    if family == "llama3":
        # Llama-3.1-8B: theta 5e5, llama3 scaling (factor 8, low/high_freq_factor 1/4,
        # original 8192 -> 64 here, so the head's frequencies fall in all three bands);
        # the small one ties its embeddings as Llama-3.2-1B does.
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64)
        return LlamaConfig(**shape, max_position_embeddings=context, rope_parameters=rope,
                           tie_word_embeddings=small, rms_norm_eps=1e-5, **common), LlamaForCausalLM
    if family == "llama-linear":
        # LongChat-7B-16k: linear position interpolation (factor 8 there, 4 here).
        rope = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
        return LlamaConfig(**shape, max_position_embeddings=context, rope_parameters=rope,
                           **untied, **common), LlamaForCausalLM
    if family == "llama-dynamic":
        # Dynamic NTK scaling (factor 2): frequencies recomputed past max_position_embeddings.
        rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
        return LlamaConfig(**shape, max_position_embeddings=context, rope_parameters=rope,
                           **untied, **common), LlamaForCausalLM
    if family == "llama-yarn":
        # Yarn-Llama-2-64k: yarn (factor 16, original 4096 there; 4 and context/4 here):
        # its attention_factor scales cos/sin.
        rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                    original_max_position_embeddings=context // 4)
        return LlamaConfig(**shape, max_position_embeddings=context, rope_parameters=rope,
                           **untied, **common), LlamaForCausalLM
    if family == "mistral":
        # Mistral-7B-v0.1: GQA, sliding_window 4096 (8 here) on every layer.
        return MistralConfig(**shape, max_position_embeddings=context, sliding_window=8,
                             rms_norm_eps=1e-5, **untied, **common), MistralForCausalLM
    if family == "qwen3":
        # Qwen3-0.6B: head_dim 128 with hidden/heads 64 (here 24 vs 16), q/k RMSNorm per
        # head, theta 1e6, tied embeddings. The small one sets attention_bias, a flag of
        # the family no published size uses, so that q/k/v/o biases are covered.
        return Qwen3Config(**shape, head_dim=hidden * 3 // 8, max_position_embeddings=context,
                           rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                           attention_bias=small, tie_word_embeddings=True, **common), Qwen3ForCausalLM
    if family == "phi3":
        # Phi-3-mini-4k: fused qkv_proj and gate_up_proj, MHA, sliding_window 2047 for a
        # context of 4096 (31 here), rms_norm_eps 1e-5.
        return Phi3Config(**{**shape, "num_key_value_heads": 4}, max_position_embeddings=context,
                          original_max_position_embeddings=context, sliding_window=31, rms_norm_eps=1e-5,
                          pad_token_id=eos_id, **untied, **common), Phi3ForCausalLM
    if family == "phi3.5":
        # Phi-3.5-mini: longrope with short/long factors per frequency, original 4096 of
        # 131072 positions (48 of 256 here), a window longer than the context; and
        # partial_rotary_factor as Phi-4-mini (same class) has it.
        rotary_half = (hidden // 4) // 4  # head_dim * 0.5 / 2
        rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                    short_factor=[1.0 + 0.05 * i for i in range(rotary_half)],
                    long_factor=[1.0 + 1.5 * i**1.5 for i in range(rotary_half)],
                    original_max_position_embeddings=48)
        return Phi3Config(**{**shape, "num_key_value_heads": 4}, max_position_embeddings=context,
                          original_max_position_embeddings=48, rope_parameters=rope,
                          sliding_window=2 * context, rms_norm_eps=1e-5, pad_token_id=eos_id, **untied,
                          **common), Phi3ForCausalLM
    if family == "gemma2":
        # gemma-2-2b: head_dim 256, query_pre_attn_scalar (here 24, not head_dim 16, as
        # gemma-2-27b's differs from its head_dim), soft-capping of attention scores (50)
        # and logits (30), sliding_window 4096 (8 here) on alternating layers, GeGLU,
        # tied embeddings. Caps lowered (5, 10) so that the tiny model's scores reach them.
        return Gemma2Config(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            query_pre_attn_scalar=24, max_position_embeddings=context, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"],
                            attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                            hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                            initializer_range=0.2, **common), Gemma2ForCausalLM
    if family == "gemma3":
        # gemma-3-4b text: q/k norms, a local RoPE base (rope_local_base_freq 1e4) on
        # sliding layers and a global one (1e6, linear factor 8) on full ones, 5 sliding
        # layers per full one (1:1 here), sliding_window 1024 (8 here), one KV head,
        # query_pre_attn_scalar apart from head_dim, tied embeddings.
        return Gemma3TextConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                query_pre_attn_scalar=32, max_position_embeddings=context, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0},
                                },
                                hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                                initializer_range=0.2, **common), Gemma3ForCausalLM
    if family == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=256, **untied, **common), GPT2LMHeadModel
    raise ValueError(family)


# The families benchmarks/batching.py runs at a larger size (scaled_config):
# one per distinct structure; the RoPE variants of Llama and Phi-3.5's longrope
# cost what their base family costs.
BENCH_FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def scaled_config(family: str, vocab: int, eos_id: int, hidden: int, layers: int, heads: int, kv_heads: int):
    """A config of `family` with its quirks (as _config) at another size, for
    benchmarks: windows as long as the context (the published ones are longer
    than a benchmark's sequences) and head_dim = hidden / heads."""
    config, _ = _config(family, "target", vocab, eos_id, context=4096)
    head_dim = hidden // heads
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 3 * hidden, layers
    config.num_attention_heads = heads
    config.num_key_value_heads = heads if family == "phi3" else kv_heads  # Phi-3-mini is MHA
    if hasattr(config, "head_dim"):
        config.head_dim = head_dim
    if getattr(config, "query_pre_attn_scalar", None):
        config.query_pre_attn_scalar = head_dim
    if getattr(config, "sliding_window", None):
        config.sliding_window = 4096
    if family.startswith("gemma"):  # alternating sliding and full layers, as published
        config.layer_types = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    elif getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1] * layers
    return config


def _randomise_norms(model, gemma: bool) -> None:
    """Norm weights around 1 instead of HF's exact ones, so a mistake in applying
    them shows (Gemma stores weight - 1: its norms scale by 1 + weight)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if gemma else 1.0))


def build_model(out_dir: str | os.PathLike, family: str, size: str, seed: int,
                tokenizer: PreTrainedTokenizerFast, logit_scale: float = 1.0, context: int = 256,
                rows: int | None = None, random_norms: bool | None = None) -> str:
    """Save a random-init model + tokenizer to out_dir; return the path.

    logit_scale multiplies the output layer so tiny random models have peaked,
    differing distributions (more realistic than near-uniform logits); with tied
    embeddings it scales the input embeddings too. random_norms: norm weights
    around 1 (default: for every family but the original llama and qwen2).
    rows: embedding / LM-head rows (default: the tokenizer's size); more pads
    the table like real checkpoints do, with random rows that are not
    suppressed, so the model really emits padding ids sometimes.
    """
    torch.manual_seed(seed)
    config, cls = _config(family, size, rows or len(tokenizer), tokenizer.eos_token_id, context)
    model = cls(config)
    if random_norms if random_norms is not None else family not in PLAIN_NORMS:
        _randomise_norms(model, family.startswith("gemma"))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def build_pair(root: str | os.PathLike, family: str, target_scale: float = 15.0,
               drafter_scale: float = 30.0) -> tuple[str, str]:
    """(target_dir, drafter_dir) for one family under root."""
    root = Path(root)
    tok = build_tokenizer(root / "tokenizer")
    target = build_model(root / f"{family}-target", family, "target", 1, tok, target_scale)
    drafter = build_model(root / f"{family}-drafter", family, "drafter", 2, tok, drafter_scale)
    return target, drafter


def build_chat_pair(root: str | os.PathLike, family: str = "llama") -> tuple[str, str]:
    """(target_dir, drafter_dir) on the chat tokenizer: the drafter is the
    target plus noise, so drafts are sometimes kept and sometimes not."""
    root = Path(root)
    tok = build_chat_tokenizer(root / "chat-tokenizer")
    target = build_model(root / f"{family}-chat-target", family, "target", 1, tok, 15.0)
    return target, build_perturbed_drafter(target, root / f"{family}-chat-noisy", noise=0.3)


def build_perturbed_drafter(target_dir: str, out_dir: str | os.PathLike, noise: float, seed: int = 7,
                            rows: int | None = None) -> str:
    """A drafter that is the target plus relative Gaussian noise on every weight:
    same architecture, correlated but really different distributions, so that
    tests see a mix of accepted and rejected drafts. rows: resize its embedding
    and LM-head tables to this many rows (dropping the last ones, or adding
    random ones), as a padded pair's drafter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise * p.std().clamp_min(1e-3))
    if rows:
        head = model.get_output_embeddings().weight
        scale = float(head.detach().std())
        model.resize_token_embeddings(rows, mean_resizing=False)
        with torch.no_grad():  # new head rows as random as the old ones (not suppressed)
            new = model.get_output_embeddings().weight
            if rows > head.shape[0]:
                new[head.shape[0]:] = torch.randn_like(new[head.shape[0]:]) * scale
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out_dir)
    return str(out_dir)


def build_padded_pair(root: str | os.PathLike, family: str, target_rows: int, drafter_rows: int,
                      noise: float = 0.3) -> tuple[str, str]:
    """(target_dir, drafter_dir) with the SAME tokenizer (VOCAB tokens) but
    embedding tables of different sizes, both padded past the tokenizer, like
    Qwen2.5-7B (152,064 rows) with Qwen2.5-0.5B (151,936). The drafter is the
    target plus noise (so drafts are often kept), resized to drafter_rows."""
    root = Path(root)
    tok = build_tokenizer(root / "tokenizer")
    target = build_model(root / f"{family}-target-{target_rows}", family, "target", 1, tok, 15.0,
                         rows=target_rows)
    drafter = build_perturbed_drafter(target, root / f"{family}-drafter-{drafter_rows}", noise,
                                      rows=drafter_rows)
    return target, drafter

"""Tiny random-initialised HF models with a real tokenizer, saved to a directory
and loaded back like a user's checkpoint. No hub access needed.

Two families (Llama, Qwen2) share one byte-level BPE tokenizer; each family has a
"target" and a differently seeded, smaller "drafter", so draft and target
distributions really differ. `build_chat_tokenizer` saves a separate tokenizer
with a real family's chat template, for chat models built on it.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 384
EOS = "<|endoftext|>"


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
    hidden, layers = (64, 2) if size == "target" else (32, 1)
    common = dict(vocab_size=vocab, eos_token_id=eos_id, bos_token_id=eos_id)
    if family == "llama":
        return LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=context, **common), LlamaForCausalLM
    if family == "qwen2":
        return Qwen2Config(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, **common), Qwen2ForCausalLM
    if family == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=256, **common), GPT2LMHeadModel
    raise ValueError(family)


def build_model(out_dir: str | os.PathLike, family: str, size: str, seed: int,
                tokenizer: PreTrainedTokenizerFast, logit_scale: float = 1.0, context: int = 256,
                rows: int | None = None) -> str:
    """Save a random-init model + tokenizer to out_dir; return the path.

    logit_scale multiplies the output layer so tiny random models have peaked,
    differing distributions (more realistic than near-uniform logits).
    rows: embedding / LM-head rows (default: the tokenizer's size); more pads
    the table like real checkpoints do, with random rows that are not
    suppressed, so the model really emits padding ids sometimes.
    """
    torch.manual_seed(seed)
    config, cls = _config(family, size, rows or len(tokenizer), tokenizer.eos_token_id, context)
    config.tie_word_embeddings = False
    model = cls(config)
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

"""Architectures of the demo pair (both Llama, same tokenizer).

Target ~7.4 M params; drafter ~1.1 M (< 1/6 of the target, so drafting stays cheap).
The drafter is deep-narrow-ish (3 layers of 128) rather than 2 layers: at this
size the extra layer is cheap and buys acceptance.
"""
from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

MAX_POS = 1024


def _config(vocab_size: int, eot_id: int, hidden: int, layers: int, heads: int,
            intermediate: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_POS,
        tie_word_embeddings=True,  # halves the embedding cost of small models
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        rope_theta=10000.0,
    )


def target_config(vocab_size: int, eot_id: int) -> LlamaConfig:
    return _config(vocab_size, eot_id, hidden=256, layers=8, heads=4, intermediate=688)


def drafter_config(vocab_size: int, eot_id: int) -> LlamaConfig:
    return _config(vocab_size, eot_id, hidden=128, layers=3, heads=4, intermediate=344)


def n_params(model) -> int:
    # parameters() de-duplicates tied weights, so this counts the embedding once.
    return sum(p.numel() for p in model.parameters())


def build(config: LlamaConfig) -> LlamaForCausalLM:
    return LlamaForCausalLM(config)

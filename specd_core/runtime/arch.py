"""What the lean engine (specd_core/runtime/lean.py) needs to know of a decoder family,
read from its Hugging Face config - and which configs it covers exactly.

Covered (each checked against Hugging Face's own forward, tests/test_families.py):
Llama 1-3.3 (model_type llama), Mistral, Qwen2/2.5, Qwen3, Phi-3/3.5 (phi3),
Gemma-2, Gemma-3 text (gemma3_text). `describe` returns None with a reason for
anything else, so that a config feature the lean forward does not implement falls
back to Hugging Face's forward instead of computing something different.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd_core.runtime import rope

# model_type -> how its layers' attention windows are configured:
#   "none": no sliding window; "all": config.sliding_window (or None) on every
#   layer (Mistral, Phi-3); "layer_types": config.layer_types picks per layer.
WINDOWS = {
    "llama": "none",
    "mistral": "all",
    "phi3": "all",
    "qwen2": "layer_types",
    "qwen3": "layer_types",
    "gemma2": "layer_types",
    "gemma3_text": "layer_types",
}
GEMMA = {"gemma2", "gemma3_text"}
ACTIVATIONS = {"silu", "gelu_pytorch_tanh", "gelu"}
LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class Arch:
    family: str  # the config's model_type
    gemma_norm: bool  # RMSNorm scales by (1 + weight), in float32 (Gemma)
    sandwich: bool  # norms after attention and around the MLP too (Gemma)
    embed_scale: float | None  # embeddings times sqrt(hidden), in the model dtype (Gemma)
    act: str  # the MLP's gate activation (ACTIVATIONS)
    attn_scale: float  # query scaling: head_dim**-0.5, or query_pre_attn_scalar**-0.5 (Gemma)
    attn_softcap: float | None  # tanh soft-capping of attention scores (Gemma-2)
    final_softcap: float | None  # tanh soft-capping of the logits (Gemma)
    windows: tuple[int | None, ...]  # per layer: its sliding window, None = full attention
    rope_keys: tuple[str | None, ...]  # per layer: its RoPE parameters (a layer type for Gemma-3; None = the one set)


def _window_of_layers(config, kind: str) -> tuple[int | None, ...] | str:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if kind == "none":
        return (None,) * n
    if kind == "all":
        return (window,) * n
    types = getattr(config, "layer_types", None)
    if types is None:
        return "no layer_types"
    if len(types) < n or not set(types[:n]) <= LAYER_TYPES:
        return f"layer_types {sorted(set(types))} (covered: {sorted(LAYER_TYPES)})"
    if "sliding_attention" in types[:n] and not isinstance(window, int):
        return f"sliding layers with sliding_window={window!r}"
    return tuple(window if t == "sliding_attention" else None for t in types[:n])


def _rope_keys(config, family: str) -> tuple[str | None, ...] | str:
    n = config.num_hidden_layers
    if family == "gemma3_text":
        keys = tuple(config.layer_types[:n])
        if not all(isinstance(config.rope_parameters.get(k), dict) for k in set(keys)):
            return "a layer type without RoPE parameters"
        return keys
    return (None,) * n


def describe(config) -> Arch | str:
    """The lean engine's description of a config, or why it does not cover it."""
    family = getattr(config, "model_type", None)
    if family not in WINDOWS:
        return f"model_type {family!r} (covered: {', '.join(sorted(WINDOWS))})"
    if getattr(config, "quantization_config", None) is not None:
        return "quantized weights"
    act = getattr(config, "hidden_activation", None) if family in GEMMA else getattr(config, "hidden_act", None)
    if act not in ACTIVATIONS:
        return f"activation {act!r} (covered: {sorted(ACTIVATIONS)})"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if family == "gemma3_text" and getattr(config, "attn_logit_softcapping", None) is not None:
        # Gemma-3's attention does not pass it on: whether it applies depends on the attention backend.
        return "attn_logit_softcapping on Gemma-3"
    windows = _window_of_layers(config, WINDOWS[family])
    if isinstance(windows, str):
        return windows
    keys = _rope_keys(config, family)
    if isinstance(keys, str):
        return keys
    for key in set(keys):
        params = rope.rope_params(config, key) or {}
        kind = params.get("rope_type", "default")
        if kind not in rope.SUPPORTED:
            return f"rope_type {kind!r} (covered: {sorted(rope.SUPPORTED)})"
        if params.get("mrope_section") is not None:
            return "multimodal RoPE sections"
        # Only Phi-3's attention rotates part of a head; the others would fail or differ.
        if family != "phi3" and params.get("partial_rotary_factor", 1.0) != 1.0:
            return f"partial_rotary_factor {params['partial_rotary_factor']} outside Phi-3"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    gemma = family in GEMMA
    return Arch(
        family=family,
        gemma_norm=gemma,
        sandwich=gemma,
        embed_scale=config.hidden_size**0.5 if gemma else None,
        act=act,
        attn_scale=config.query_pre_attn_scalar**-0.5 if gemma else head_dim**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if family == "gemma2" else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        windows=windows,
        rope_keys=keys,
    )

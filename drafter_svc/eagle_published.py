"""Building the published EAGLE-1/2 and EAGLE-3 heads
(specd_core/runtime/head_formats.py) as a one-layer Llama the lean forward
runs, plus the input rule of their format (drafter_svc/head_input.py).

The one-layer model is made on the meta device and given only the head's
tensors and the target's shared ones (embedding, and for EAGLE-1/2 the LM
head): a published head's vocabulary is the target's (128k rows for Llama 3),
so a randomly initialised table that is then overwritten would cost seconds
and gigabytes for nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from drafter_svc.head_input import Eagle3Input, FusedInput
from specd_core.runtime.head_formats import fit_problem, head_format, load_weights, read_config
from specd_core.runtime.models import resolve_device, torch_dtype

# The head config's fields the one-layer Llama takes as they are.
_LLAMA_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "hidden_act",
)


def _one_layer_model(head_cfg: dict, target):
    """An empty (meta) one-layer LlamaForCausalLM with the head's dimensions
    and RoPE, the target's vocabulary size and end tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: head_cfg[k] for k in _LLAMA_FIELDS if head_cfg.get(k) is not None}
    # Published heads often state a shorter context than their target's (2048
    # for Llama 3.1's EAGLE-3 head); the head drafts wherever the target runs.
    fields["max_position_embeddings"] = max(
        fields.get("max_position_embeddings", 0), target.config.max_position_embeddings
    )
    cfg = LlamaConfig(
        **fields,
        num_hidden_layers=1,
        vocab_size=target.config.vocab_size,
        tie_word_embeddings=False,
        eos_token_id=target.config.eos_token_id,
        bos_token_id=target.config.bos_token_id,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


class _Placer:
    """Puts tensors into the meta model's modules, on the serving device and dtype."""

    def __init__(self, device: str | torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device, self.dtype)

    def put(self, module, t: torch.Tensor) -> None:
        module.weight = nn.Parameter(self.tensor(t), requires_grad=False)

    def layer(self, layer, w: dict, prefix: str) -> None:
        """A decoder layer's projections and post-attention norm from `prefix`.*."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            self.put(getattr(layer.self_attn, name), w[f"{prefix}.self_attn.{name}.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            self.put(getattr(layer.mlp, name), w[f"{prefix}.mlp.{name}.weight"])
        self.put(layer.post_attention_layernorm, w[f"{prefix}.post_attention_layernorm.weight"])


def _load_target(head_dir: str, target_dir: str):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    problem = fit_problem(head_dir, target.config)
    if problem:
        raise ValueError(problem)
    return target


def _start(head_dir: str, target_dir: str, device: str, dtype: str):
    """What both published formats start from: the target (checked against
    the head), the head's weights, a placer on the resolved device and dtype,
    and an empty one-layer model shaped by the head's config."""
    target = _load_target(head_dir, target_dir)
    dev = resolve_device(device)
    at = _Placer(dev, torch_dtype(target_dir, dtype, dev))
    return target, load_weights(head_dir), at, _one_layer_model(read_config(head_dir), target)


def build_eagle(head_dir: str, target_dir: str, device: str = "auto", dtype: str = "default"):
    """A published EAGLE-1/2 head: (one-layer model, FusedInput). Its layer has
    no input norm and the target's LM head reads its output without a norm;
    its features are the target's after the final norm (head_input.FusedInput)."""
    target, w, at, model = _start(head_dir, target_dir, device, dtype)
    layer = model.model.layers[0]
    at.layer(layer, w, "layers.0")
    layer.input_layernorm = None
    model.model.norm = None
    at.put(model.model.embed_tokens, w.get("embed_tokens.weight", target.model.embed_tokens.weight))
    at.put(model.lm_head, target.lm_head.weight)
    bias = w.get("fc.bias")
    rule = FusedInput(
        at.tensor(w["fc.weight"]),
        at.tensor(bias) if bias is not None else None,
        feature_norm=at.tensor(target.model.norm.weight),
        eps=target.config.rms_norm_eps,
    )
    return model.eval(), rule


def build_eagle3(head_dir: str, target_dir: str, device: str = "auto", dtype: str = "default"):
    """A published EAGLE-3 head: (one-layer model, Eagle3Input). The model's
    LM head is the head's own over the draft vocabulary; Eagle3Input maps it
    to target ids with d2t."""
    target, w, at, model = _start(head_dir, target_dir, device, dtype)
    layer = model.model.layers[0]
    at.layer(layer, w, "midlayer")
    at.put(layer.input_layernorm, w["midlayer.input_layernorm.weight"])
    at.put(model.model.norm, w["norm.weight"])
    at.put(model.lm_head, w["lm_head.weight"])
    at.put(model.model.embed_tokens, w.get("embed_tokens.weight", target.model.embed_tokens.weight))
    draft_vocab = w["lm_head.weight"].shape[0]
    d2t = w["d2t"].long() if "d2t" in w else torch.zeros(draft_vocab, dtype=torch.long)
    rule = Eagle3Input(
        at.tensor(w["fc.weight"]),
        at.tensor(w["midlayer.hidden_norm.weight"]),
        (torch.arange(draft_vocab) + d2t).to(at.device),
        target.config.vocab_size,
    )
    return model.eval(), rule


def build_published(head_dir: str, target_dir: str, device: str = "auto", dtype: str = "default"):
    """(one-layer model, input rule) of a published head directory."""
    fmt = head_format(head_dir)
    if fmt == "eagle3":
        return build_eagle3(head_dir, target_dir, device, dtype)
    if fmt == "eagle":
        return build_eagle(head_dir, target_dir, device, dtype)
    raise ValueError(f"{head_dir} is not a published EAGLE or EAGLE-3 head")

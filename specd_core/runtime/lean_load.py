"""Building a LeanModel straight from a checkpoint directory, without
Hugging Face's modeling stack.

Why: the lean engine (specd_core/runtime/lean.py) only reads a loaded HF
model's weights and config, yet `AutoModelForCausalLM.from_pretrained` first
imports transformers' modeling stack (modeling_utils, masking_utils and the
family's modeling_* module): about 1 s of CPU in every fresh process (each
Ray actor, each replica restart), against ~0.1 s for the weights themselves.

Here the config still comes from `AutoConfig` (the config classes normalise
what the lean engine reads: legacy rope_scaling into rope_parameters, default
layer_types, head_dim, Qwen2's use_sliding_window) and the weights from the
safetensors files. The LeanModel is built from a tree of plain objects whose
attribute paths are the checkpoint's tensor names - exactly the paths
`LeanModel` reads on an HF model - so the lean engine has one constructor.

`load_lean` returns None where this path would not reproduce HF's load: a
config the lean engine does not cover, no safetensors weights (only
pytorch_model.bin), tensor names other than the HF layout (checkpoints HF
renames while loading), or an output layer that is missing or disagrees with
tied embeddings. Callers fall back to load_model + LeanModel then.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from specd_core.runtime.lean import LeanModel, supports
from specd_core.runtime.models import resolve_device, torch_dtype

__all__ = ["DefaultRope", "load_lean", "read_weights"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PREFIXES = ("model.", "lm_head.")


class DefaultRope:
    """Stands for the HF model's rotary module: rope.Rope takes the "default"
    RoPE frequencies from `type(rotary_emb).compute_default_rope_parameters`,
    which lives in the family's modeling_* module (the import to avoid).
    This is the same formula; partial_rotary_factor counts as Phi-3's does
    (arch.describe refuses a factor other than 1 for every other family, for
    which it changes nothing)."""

    @staticmethod
    def compute_default_rope_parameters(config, device=None, layer_type: str | None = None, **kwargs):
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        base = params["rope_theta"]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq.to(device), 1.0


def _weight_files(model_dir: str) -> list[str] | None:
    """The safetensors files of a checkpoint (one, or the shards its index
    names); None when it has none."""
    if os.path.isfile(os.path.join(model_dir, SINGLE)):
        return [os.path.join(model_dir, SINGLE)]
    index = os.path.join(model_dir, INDEX)
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(model_dir, s) for s in shards]


def read_weights(model_dir: str, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Every tensor of the checkpoint on `device` in `dtype`, as
    from_pretrained(dtype=...).to(device) leaves a model's floating-point
    parameters; None without safetensors weights."""
    files = _weight_files(model_dir)
    if files is None:
        return None
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(path))
    # Cast on the CPU, then move: the same two steps, in the same order, as the HF path.
    return {k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in weights.items()}


def _node(tree: dict) -> SimpleNamespace | list:
    """A nested dict of tensor-name parts as attribute objects; numbered
    children (model.layers.0 ...) as a list."""
    if tree and all(k.isdigit() for k in tree):
        return [_node(tree[str(i)]) for i in range(len(tree))]
    obj = SimpleNamespace(**{k: v if isinstance(v, torch.Tensor) else _node(v) for k, v in tree.items()})
    if hasattr(obj, "weight") and not hasattr(obj, "bias"):
        obj.bias = None  # as an nn.Linear without bias: LeanModel reads `.bias`
    return obj


def _module_tree(weights: dict[str, torch.Tensor]) -> SimpleNamespace | None:
    """The checkpoint's tensors as HF's module attribute paths; None when a
    name is outside the HF layout or the layers are not numbered 0..n-1."""
    tree: dict = {}
    for name, tensor in weights.items():
        if not name.startswith(PREFIXES):
            return None
        *parts, leaf = name.split(".")
        at = tree
        for p in parts:
            at = at.setdefault(p, {})
        at[leaf] = tensor
    layers = tree.get("model", {}).get("layers", {})
    if sorted(layers) != sorted(str(i) for i in range(len(layers))):
        return None
    node = _node(tree)
    return node if isinstance(node, SimpleNamespace) else None


def _output_layer(root: SimpleNamespace, config) -> bool:
    """Point lm_head at the embeddings where the config ties them, as HF does;
    False where that would not give HF's output layer."""
    embed = root.model.embed_tokens.weight
    head = getattr(root, "lm_head", None)
    if getattr(config, "tie_word_embeddings", False):
        if head is not None and not torch.equal(head.weight, embed):
            return False  # which of the two HF would keep is not worth guessing
        root.lm_head = SimpleNamespace(weight=embed, bias=None)
        return True
    return head is not None  # untied without an output layer: HF would initialise it randomly


def load_lean(model_dir: str, device: str = "auto", dtype: str = "default") -> LeanModel | None:
    """A LeanModel of the checkpoint in model_dir, equal to LeanModel(load_model(...))
    with the same device and dtype, without importing HF's modeling stack;
    None where this path does not cover the checkpoint (module docstring)."""
    device = resolve_device(device)
    config = AutoConfig.from_pretrained(model_dir)
    if not supports(config):
        return None
    weights = read_weights(model_dir, device, torch_dtype(model_dir, dtype, device))
    root = _module_tree(weights) if weights is not None else None
    if root is None or not hasattr(root, "model") or not _output_layer(root, config):
        return None
    if len(getattr(root.model, "layers", [])) != config.num_hidden_layers:
        return None
    first = root.model.embed_tokens.weight
    root.config, root.device = config, first.device
    root.parameters = lambda: iter([first])
    root.model.rotary_emb = DefaultRope()
    try:
        return LeanModel(root)
    except AttributeError:
        # A tensor the lean engine reads is not in the checkpoint: HF would
        # initialise it randomly (or rename it while loading), neither worth copying.
        return None

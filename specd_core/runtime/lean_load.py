"""Building a LeanModel straight from a checkpoint directory, without
Hugging Face's modeling stack.

Why: the lean engine (specd_core/runtime/lean.py) only reads a loaded HF
model's weights and config, yet `AutoModelForCausalLM.from_pretrained` first
imports transformers' modeling stack (modeling_utils, masking_utils and the
family's modeling_* module) and the family's config module: about 2.5 s of
CPU in every fresh process (each Ray actor, each replica restart), against
~0.1 s for the weights themselves.

Here the config is config.json read into transformers' base config class
where it was saved by transformers 5 with every field the lean engine reads
(read_config; else AutoConfig, whose family classes convert older forms), and
the weights come from the safetensors files. The LeanModel is built from a
tree of plain objects whose attribute paths are the checkpoint's tensor names
- exactly the paths `LeanModel` reads on an HF model - so the lean engine
keeps one constructor.

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
from typing import Any

import torch
from safetensors.torch import load_file

from specd_core.runtime.lean import LeanModel, supports
from specd_core.runtime.models import _DTYPES, DTYPE_CHOICES, checkpoint_dtype, load_model, resolve_device

__all__ = ["Checkpoint", "DefaultRope", "load_checkpoint", "load_lean", "read_config", "read_weights"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PREFIXES = ("model.", "lm_head.")
# The config fields the lean engine, arch.describe and HF's RoPE functions read,
# per family: read_config takes config.json as it is only when it names them all.
# head_dim only where the family's class has one (Qwen2 and Phi-3 derive it,
# as getattr(config, "head_dim", None) does on the base class); Phi-3's
# original_max_position_embeddings changes how HF standardises longrope parameters.
COMMON_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "rms_norm_eps", "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
)  # fmt: skip
GEMMA_KEYS = ("hidden_activation", "head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar",
              "attn_logit_softcapping", "final_logit_softcapping")  # fmt: skip
FAMILY_KEYS = {
    "llama": ("hidden_act", "head_dim"),
    "mistral": ("hidden_act", "head_dim", "sliding_window"),
    "phi3": ("hidden_act", "sliding_window", "original_max_position_embeddings"),
    "qwen2": ("hidden_act", "sliding_window", "layer_types"),
    "qwen3": ("hidden_act", "head_dim", "sliding_window", "layer_types"),
    "gemma2": GEMMA_KEYS,
    "gemma3_text": GEMMA_KEYS,
}


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


def _complete(d: dict) -> bool:
    """Whether a config.json can be used without its family's config class:
    written by transformers 5 or later (which saves the class's normalised
    fields: rope_parameters with rope_theta, layer_types, head_dim), naming
    every field the lean engine reads, and no legacy RoPE fields to convert."""
    version = str(d.get("transformers_version", "0")).split(".")[0]
    if not version.isdigit() or int(version) < 5 or d.get("model_type") not in FAMILY_KEYS:
        return False
    if not all(k in d for k in COMMON_KEYS + FAMILY_KEYS[d["model_type"]]):
        return False
    if "rope_scaling" in d or "rope_theta" in d or not isinstance(d["rope_parameters"], dict):
        return False
    params = d["rope_parameters"]
    nested = [params[t] for t in set(d.get("layer_types") or ()) if t in params]
    return all(isinstance(p, dict) and "rope_theta" in p for p in (nested or [params]))


def read_config(model_dir: str):
    """The checkpoint's config: config.json as a plain PreTrainedConfig where
    _complete says that reads as the family's class would, else AutoConfig.

    Why not always AutoConfig: every family's configuration module imports
    transformers.utils.type_validators, which imports transformers.activations
    and torch.distributed.tensor - about 1.4 s of CPU, more than the rest of
    the load. The base class (configuration_utils) costs ~0.01 s."""
    with open(os.path.join(model_dir, "config.json")) as f:
        d = json.load(f)
    if not _complete(d):
        from transformers import AutoConfig  # imported here: the auto module alone costs ~0.5 s

        return AutoConfig.from_pretrained(model_dir)
    from transformers.configuration_utils import PreTrainedConfig

    return PreTrainedConfig(**d)


def _dtype(config, dtype: str, device: str) -> torch.dtype:
    """models.resolve_dtype over an already read config (it reads its own with AutoConfig)."""
    if dtype == "default":
        dtype = "float32" if device == "cpu" else "auto"
    if dtype == "auto":
        dtype = checkpoint_dtype(config)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    return _DTYPES[dtype]


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


def _required(family: str, layers: int) -> set[str]:
    """The tensors (weights; biases are optional) every checkpoint of a family
    has: without one, HF would initialise it and the lean engine would skip or miss it."""
    attn = ["qkv_proj"] if family == "phi3" else ["q_proj", "k_proj", "v_proj"]
    attn += ["o_proj"] + (["q_norm", "k_norm"] if family in ("qwen3", "gemma3_text") else [])
    mlp = (["gate_up_proj"] if family == "phi3" else ["gate_proj", "up_proj"]) + ["down_proj"]
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family in ("gemma2", "gemma3_text"):
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    per_layer = [f"self_attn.{a}" for a in attn] + [f"mlp.{m}" for m in mlp] + norms
    names = {f"model.layers.{i}.{n}.weight" for i in range(layers) for n in per_layer}
    return names | {"model.embed_tokens.weight", "model.norm.weight"}


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


class Checkpoint:
    """A checkpoint's weights under HF's module paths (`.model.layers[i].self_attn.q_proj.weight`,
    `.lm_head.weight`) with what the lean engine and ModelCore read of a loaded
    HF model: config, device, dtype, parameters(), get_output_embeddings().

    Calling it runs HF's forward on the HF model, loaded (load_model) on the
    first call: tests and tools use a core's model as an oracle, and pay the
    modeling stack's import only then. The engines never call it (Runner
    refuses the hf engine on it: `lean_only`)."""

    lean_only = True

    def __init__(self, root: SimpleNamespace, config, source: tuple[str, str, str]):
        self.model, self.lm_head, self.config = root.model, root.lm_head, config
        self.model.rotary_emb = DefaultRope()
        self.device = self.model.embed_tokens.weight.device
        self.dtype = self.model.embed_tokens.weight.dtype
        self._source = source  # (model_dir, device, dtype) for load_model
        self._hf: Any = None

    def parameters(self):
        yield self.model.embed_tokens.weight  # LeanModel reads the dtype of the first, as HF's

    def get_output_embeddings(self):
        return self.lm_head

    def __call__(self, *args, **kwargs):
        if self._hf is None:
            self._hf = load_model(*self._source)
        return self._hf(*args, **kwargs)


def load_checkpoint(model_dir: str, device: str = "auto", dtype: str = "default") -> Checkpoint | None:
    """The checkpoint in model_dir for the lean engine, with the weights
    load_model(model_dir, device, dtype) would give, without importing HF's
    modeling stack; None where this path does not cover it (module docstring)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return None  # not a checkpoint directory: HF's load says what is wrong
    device = resolve_device(device)
    config = read_config(model_dir)
    if not supports(config):
        return None
    weights = read_weights(model_dir, device, _dtype(config, dtype, device))
    if weights is None or not _required(config.model_type, config.num_hidden_layers) <= weights.keys():
        return None
    root = _module_tree(weights)
    if root is None or len(root.model.layers) != config.num_hidden_layers or not _output_layer(root, config):
        return None
    return Checkpoint(root, config, (model_dir, device, dtype))


def load_lean(model_dir: str, device: str = "auto", dtype: str = "default") -> LeanModel | None:
    """LeanModel(load_model(model_dir, device, dtype)) from the checkpoint
    directly; None where load_checkpoint does not cover it."""
    ckpt = load_checkpoint(model_dir, device, dtype)
    return LeanModel(ckpt) if ckpt is not None else None

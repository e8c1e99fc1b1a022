"""Published Medusa heads (Cai et al. 2024) in their two layouts, read into one
form: per head, its residual layers and its LM head.

* The original layout (the Medusa authors' training code): config.json with
  `medusa_num_heads` and `medusa_num_layers` (usually also
  `base_model_name_or_path`, `hidden_size`, `vocab_size`); head i is
  `medusa_head.{i}.{j}.linear.weight` / `.bias` for its residual layers
  j < num_layers and `medusa_head.{i}.{num_layers}.weight` for its LM head
  (vocabulary x hidden, no bias). The weights are in medusa_lm_head.safetensors,
  medusa_lm_head.pt or a full checkpoint's model file; a head-only file saved
  from the ModuleList has no `medusa_head.` prefix, which is accepted too.
* vLLM's layout: config `architectures: ["MedusaModel"]`, `num_heads`,
  `num_hidden_layers` (residual layers per head), `hidden_size`, `vocab_size`
  and optionally `truncated_vocab_size`; head i is `blocks.{i}.layers.{j}.weight`
  (and `.bias` when `medusa_fc_bias`) and `lm_heads.{i}.weight`. With a
  truncated vocabulary, `token_map` gives the target id of each draft row; with
  `original_lm_head` all heads share one `lm_head.weight`; `logit_scale`
  multiplies the logits.

A residual layer is x + SiLU(W x + b). Every head reads the same feature: the
target's last hidden state after its final norm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

MEDUSA_ARCH = "MedusaModel"
# Where each layout keeps its weights, first found wins.
_FILES = ("medusa_lm_head.safetensors", "model.safetensors", "medusa_lm_head.pt", "pytorch_model.bin")
_ORIGINAL = re.compile(r"^(?:model\.)?(?:medusa_heads?\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


def is_medusa_config(cfg: dict) -> bool:
    return "medusa_num_heads" in cfg or MEDUSA_ARCH in (cfg.get("architectures") or [])


def weight_file(path) -> Path | None:
    return next((Path(path) / n for n in _FILES if (Path(path) / n).is_file()), None)


def _raw_weights(path) -> dict[str, torch.Tensor]:
    f = weight_file(path)
    if f is None:
        raise ValueError(f"{path}: no Medusa weights ({', '.join(_FILES)})")
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(f))
    # weights only: no code runs from the file
    return torch.load(str(f), map_location="cpu", weights_only=True)


@dataclass
class MedusaWeights:
    """Per head: residual layers [(W, b | None)] and its LM head (draft vocab x hidden).
    token_map: the target id of each draft row (None: the rows are the target's ids)."""

    residual: list[list[tuple[torch.Tensor, torch.Tensor | None]]]
    lm_heads: list[torch.Tensor]
    token_map: torch.Tensor | None
    logit_scale: float
    layout: str  # "original" | "vllm"

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)


def _original(cfg: dict, raw: dict) -> MedusaWeights:
    heads, layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    named: dict[tuple[int, int, str], torch.Tensor] = {}
    for k, v in raw.items():
        m = _ORIGINAL.match(k)
        if m:  # a full checkpoint also holds the base model's weights: those are not the heads'
            named[(int(m[1]), int(m[2]), m[3])] = v

    def layer(i: int, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The authors' code repeats ONE block medusa_num_layers times, so a file
        # that stores shared tensors once has only block 0 of a head.
        at = j if (i, j, "weight") in named else 0
        if (i, at, "weight") not in named:
            raise KeyError(f"medusa_head.{i}.{j}.linear.weight")
        return named[(i, at, "weight")], named.get((i, at, "bias"))

    def lm_head(i: int) -> torch.Tensor:
        if (i, layers, "weight") not in named:
            raise KeyError(f"medusa_head.{i}.{layers}.weight")
        return named[(i, layers, "weight")]

    residual = [[layer(i, j) for j in range(layers)] for i in range(heads)]
    return MedusaWeights(residual, [lm_head(i) for i in range(heads)], None, 1.0, "original")


def _vllm(cfg: dict, raw: dict) -> MedusaWeights:
    raw = {k.removeprefix("medusa_heads.").removeprefix("model."): v for k, v in raw.items()}
    heads, layers = int(cfg.get("num_heads", 5)), int(cfg.get("num_hidden_layers", 1))
    residual = [
        [(raw[f"blocks.{i}.layers.{j}.weight"], raw.get(f"blocks.{i}.layers.{j}.bias")) for j in range(layers)]
        for i in range(heads)
    ]
    shared = raw.get("lm_head.weight") if cfg.get("original_lm_head") else None
    lm_heads = [shared if shared is not None else raw[f"lm_heads.{i}.weight"] for i in range(heads)]
    token_map = raw.get("token_map")
    return MedusaWeights(
        residual,
        lm_heads,
        token_map.long() if token_map is not None else None,
        float(cfg.get("logit_scale", 1.0)),
        "vllm",
    )


def load_medusa(path, cfg: dict) -> MedusaWeights:
    """The heads of a Medusa directory (either layout); KeyError names a missing tensor."""
    raw = _raw_weights(path)
    return _original(cfg, raw) if "medusa_num_heads" in cfg else _vllm(cfg, raw)


def medusa_problem(path, cfg: dict, hidden_size: int, vocab_size: int) -> str | None:
    """How the heads do not fit a target of this hidden size and vocabulary (None: they fit)."""
    try:
        w = load_medusa(path, cfg)
    except KeyError as e:
        return f"the weights have no {e.args[0]}"
    except Exception as e:  # noqa: BLE001 - safetensors and torch.load raise their own kinds
        return f"its weights cannot be read ({type(e).__name__})"
    if w.num_heads < 1:
        return "it has no heads"
    # What the config declares first: the mismatch is then named as its author wrote it.
    declared = cfg.get("hidden_size")
    if declared is not None and declared != hidden_size:
        return f"hidden_size {declared}, the target's hidden size is {hidden_size}"
    vocab = cfg.get("vocab_size")
    if vocab is not None and vocab != vocab_size:
        return f"vocab_size {vocab}, the target's vocabulary is {vocab_size} rows"
    for i, (layers, lm) in enumerate(zip(w.residual, w.lm_heads)):
        for j, (weight, bias) in enumerate(layers):
            if tuple(weight.shape) != (hidden_size, hidden_size) or (bias is not None and bias.shape != (hidden_size,)):
                return f"head {i} layer {j} is {tuple(weight.shape)}, expected ({hidden_size}, {hidden_size})"
        rows = vocab_size if w.token_map is None else len(w.token_map)
        if tuple(lm.shape) != (rows, hidden_size):
            return f"head {i}'s LM head is {tuple(lm.shape)}, expected ({rows}, {hidden_size}) (vocabulary x hidden)"
    return None if w.token_map is None else _token_map_problem(w.token_map, vocab_size)


def _token_map_problem(ids: torch.Tensor, vocab_size: int) -> str | None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return f"token_map maps draft rows outside the target's vocabulary of {vocab_size}"
    if len(set(ids.tolist())) != ids.numel():
        return "token_map maps two draft rows to one target id"
    return None

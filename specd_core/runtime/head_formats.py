"""Draft-head directories as published: which format a directory holds, its
weights, and whether it fits a target (checked before anything starts).

Four formats, three methods:

* `specd` - specd's own EAGLE head (specd_core/runtime/eagle_head.py,
  config `kind: specd-eagle-head`), method eagle;
* `eagle` - the published EAGLE-1/2 heads (Li et al. 2024): a Llama config,
  weights `fc` (hidden x 2 hidden over [embed(x_{t+1}); f_t], optional bias),
  `layers.0.*` (one Llama decoder layer) and optionally `embed_tokens`. The
  feature f_t is the target's last hidden state AFTER its final norm (what
  the target's model returns), the layer skips its input norm (the first
  decoder layer of those heads has none), and the target's LM head reads the
  layer's output directly. Method eagle;
* `eagle3` - the published EAGLE-3 heads (Li et al. 2025): config
  `architectures: ["LlamaForCausalLMEagle3"]`, weights `fc` (hidden x 3
  target_hidden over three auxiliary layers' hidden states), `midlayer.*` (a
  decoder layer whose attention reads [input_layernorm(embed); hidden_norm(h)],
  2 hidden wide), `norm`, `lm_head` over the draft vocabulary, `d2t` (draft id
  -> target id offset) and `t2d` (mask over the target vocabulary). Method eagle3;
* `medusa` - the published Medusa heads (Cai et al. 2024), in the Medusa
  authors' layout or vLLM's (specd_core/runtime/medusa_format.py): K heads,
  each residual layers and an LM head over the target's last hidden state
  after its final norm. Method medusa.

The auxiliary layer ids name decoder layers; the state taken at id i is the
residual stream entering layer i (Hugging Face's `hidden_states[i]`), in the
order the config lists them; without `eagle_config.eagle_aux_hidden_state_layer_ids`
the published heads assume (2, L // 2, L - 3) for a target of L layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specd_core.runtime.medusa_format import is_medusa_config, medusa_problem
from specd_core.runtime.medusa_format import weight_file as medusa_weight_file

CONFIG_NAME = "config.json"
SPECD_KIND = "specd-eagle-head"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
# The method each format is served by.
METHOD_OF = {"specd": "eagle", "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa"}
PUBLISHED = ("eagle", "eagle3", "medusa")  # the formats that name no target and are checked against one


def read_config(path) -> dict:
    p = Path(path) / CONFIG_NAME
    return json.loads(p.read_text()) if p.is_file() else {}


def _weight_file(path) -> Path | None:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def _strip(name: str) -> str:
    # Some exports prefix the head's own weights with "model." (not lm_head).
    return name[len("model.") :] if name.startswith("model.") else name


def weight_names(path) -> set[str]:
    """The weight names of a directory (safetensors: read from the header only)."""
    f = _weight_file(path)
    if f is None:
        return set()
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(f), "pt") as sf:
            return {_strip(k) for k in sf.keys()}  # noqa: SIM118 (a safe_open is not iterable)
    return set(load_weights(path))


def load_weights(path) -> dict[str, torch.Tensor]:
    f = _weight_file(path)
    if f is None:
        raise ValueError(f"{path}: no model.safetensors or pytorch_model.bin")
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        raw = load_file(str(f))
    else:  # weights only: no code runs from the file
        raw = torch.load(str(f), map_location="cpu", weights_only=True)
    return {_strip(k): v for k, v in raw.items()}


def head_format(path) -> str | None:
    """ "specd" | "eagle" | "eagle3" | "medusa" for a head directory, None for anything else."""
    if not path or not Path(path).is_dir():
        return None
    cfg = read_config(path)
    if cfg.get("kind") == SPECD_KIND:
        return "specd"
    if EAGLE3_ARCH in (cfg.get("architectures") or []):
        return "eagle3"
    if is_medusa_config(cfg) and medusa_weight_file(path) is not None:
        return "medusa"
    if cfg and {"fc.weight", "layers.0.self_attn.q_proj.weight"} <= _readable_names(path):
        return "eagle"
    return None


def _readable_names(path) -> set[str]:
    """weight_names, or none when the weights cannot be read: the directory is
    then not taken for a head, and loading it as a model reports the damage
    the way a damaged model is reported (one line, at the replica's start)."""
    try:
        return weight_names(path)
    except Exception:  # noqa: BLE001 - safetensors and torch.load raise their own kinds
        return set()


def head_method(path) -> str | None:
    """The method a head directory is served by (eagle | eagle3 | medusa), None: not a head."""
    fmt = head_format(path)
    return METHOD_OF[fmt] if fmt else None


def aux_layer_ids(cfg: dict, n_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads (module docstring)."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else (2, n_layers // 2, n_layers - 3)


@dataclass(frozen=True)
class TargetShape:
    """What a head must fit: the target's hidden size, vocabulary rows, layers."""

    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def of(cls, target_config) -> TargetShape:
        return cls(target_config.hidden_size, target_config.vocab_size, target_config.num_hidden_layers)


def _shape(w: dict, name: str) -> tuple[int, ...] | None:
    return tuple(w[name].shape) if name in w else None


def _eagle3_problem(cfg: dict, w: dict, t: TargetShape) -> str | None:
    h = cfg["hidden_size"]
    th = cfg.get("target_hidden_size") or h
    dv = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    if th != t.hidden_size:
        return f"target_hidden_size {th}, the target's hidden size is {t.hidden_size}"
    if cfg["vocab_size"] != t.vocab_size:
        return f"vocab_size {cfg['vocab_size']}, the target's vocabulary is {t.vocab_size} rows"
    if _shape(w, "fc.weight") != (h, 3 * th):
        return f"fc.weight is {_shape(w, 'fc.weight')}, expected ({h}, {3 * th}) (hidden x 3 target hidden)"
    if _shape(w, "lm_head.weight") != (dv, h):
        return f"lm_head.weight is {_shape(w, 'lm_head.weight')}, expected ({dv}, {h}) (draft vocabulary x hidden)"
    embed = _shape(w, "embed_tokens.weight")
    if embed is None and h != t.hidden_size:
        return f"hidden_size {h} differs from the target's {t.hidden_size} and the head ships no embed_tokens"
    if embed is not None and embed != (t.vocab_size, h):
        return f"embed_tokens.weight is {embed}, expected ({t.vocab_size}, {h})"
    aux = list(aux_layer_ids(cfg, t.num_layers))
    if any(not 0 <= i < t.num_layers for i in aux):
        return f"aux hidden state layer ids {aux} out of range for a target of {t.num_layers} layers"
    return _d2t_problem(w, dv, t.vocab_size)


def _d2t_problem(w: dict, draft_vocab: int, vocab: int) -> str | None:
    if "d2t" not in w:
        return None if draft_vocab == vocab else "no d2t for a draft vocabulary smaller than the target's"
    d2t = w["d2t"]
    if tuple(d2t.shape) != (draft_vocab,):
        return f"d2t has {tuple(d2t.shape)} entries, expected ({draft_vocab},) (one per draft id)"
    ids = torch.arange(draft_vocab) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        return f"d2t maps draft ids outside the target's vocabulary of {vocab}"
    if "t2d" in w:
        t2d = w["t2d"]
        if tuple(t2d.shape) != (vocab,) or not bool(t2d.bool()[ids].all()) or int(t2d.bool().sum()) != draft_vocab:
            return "t2d does not mark exactly the target ids d2t maps to"
    return None


def _eagle_problem(cfg: dict, w: dict, t: TargetShape) -> str | None:
    h = cfg.get("hidden_size")
    if h != t.hidden_size:
        return f"hidden_size {h}, the target's hidden size is {t.hidden_size}"
    if _shape(w, "fc.weight") != (h, 2 * h):
        return f"fc.weight is {_shape(w, 'fc.weight')}, expected ({h}, {2 * h}) (hidden x 2 hidden)"
    embed = _shape(w, "embed_tokens.weight")
    if embed is not None and embed != (t.vocab_size, h):
        return f"embed_tokens.weight is {embed}, expected ({t.vocab_size}, {h}) (the target's vocabulary)"
    return None


def fit_problem(head_dir, target_config) -> str | None:
    """One line naming how a published head does not fit the target (None: it
    fits). specd's own heads are checked where they load (drafter_svc/eagle.py)."""
    fmt = head_format(head_dir)
    if fmt not in PUBLISHED:
        return None
    cfg, t = read_config(head_dir), TargetShape.of(target_config)
    if fmt == "medusa":
        problem = medusa_problem(head_dir, cfg, t.hidden_size, t.vocab_size)
    else:
        w = load_weights(head_dir)
        problem = _eagle3_problem(cfg, w, t) if fmt == "eagle3" else _eagle_problem(cfg, w, t)
    return f"{fmt} head {head_dir} does not fit its target: {problem}" if problem else None

"""Function-preserving "cost-scaled" padding of the demo target.

The trained demo target has ~7 M parameters; benchmarks want a target whose
*cost* is that of a ~100 M-parameter model while its *outputs* stay those of the
trained one (so acceptance figures stay meaningful). We grow the model in two
ways, both exact:

  1. Extra decoder layers appended after the trained ones, with o_proj and
     down_proj set to zero: each sub-block then adds exactly 0 to the residual
     stream, so the layer is the identity. Their other weights keep a normal
     random init, so they cost what a real layer costs.
  2. A wider MLP (intermediate_size) in every layer: the new gate/up rows are
     random, the matching new down_proj COLUMNS are zero, so the extra hidden
     units never reach the residual stream.

Llama wants a uniform per-layer shape, which is why widening applies to all
layers. Default policy: double the depth (realistic layer count, realistic KV
cache growth), then widen the MLP just enough to reach --min-params (rounded up
to a multiple of 64 for friendly kernels). The hidden size is left alone.

    python -m training.pad_target models/demo/target /tmp/target-100m --min-params 100000000

The padded model is built at benchmark time and is not committed.
"""
from __future__ import annotations

import argparse
import copy
import math
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM


def _param_count(cfg, num_layers: int, intermediate: int) -> int:
    """Parameters of a bias-free Llama with this depth and MLP width."""
    h, hd = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = h * cfg.num_attention_heads * hd * 2 + h * cfg.num_key_value_heads * hd * 2
    per_layer = attn + 3 * h * intermediate + 2 * h  # + two RMSNorm weights
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embed + h + num_layers * per_layer  # + final norm


def plan(cfg, target_params: int, num_layers: int | None = None, multiple_of: int = 64) -> tuple[int, int]:
    """(num_layers, intermediate_size) reaching >= target_params."""
    L0, I0 = cfg.num_hidden_layers, cfg.intermediate_size
    L = max(L0, num_layers if num_layers is not None else 2 * L0)
    if _param_count(cfg, L, I0) >= target_params:
        return L, I0
    per_unit = L * 3 * cfg.hidden_size  # params added per extra MLP unit (all layers)
    extra = math.ceil((target_params - _param_count(cfg, L, I0)) / per_unit)
    I = math.ceil((I0 + extra) / multiple_of) * multiple_of
    return L, I


@torch.no_grad()
def pad_model(model: LlamaForCausalLM, target_params: int = 100_000_000,
              num_layers: int | None = None, seed: int = 0) -> LlamaForCausalLM:
    """Return a new model with >= target_params parameters and identical logits."""
    cfg = model.config
    if cfg.attention_bias or cfg.mlp_bias:
        raise ValueError("pad_model assumes a bias-free Llama (as the demo models are)")
    I0 = cfg.intermediate_size
    L, I = plan(cfg, target_params, num_layers)

    new_cfg = copy.deepcopy(cfg)
    new_cfg.num_hidden_layers, new_cfg.intermediate_size = L, I
    torch.manual_seed(seed)  # the random (but inert) weights are reproducible
    dtype = next(model.parameters()).dtype
    padded = LlamaForCausalLM(new_cfg).to(dtype)

    old = model.state_dict()
    new = padded.state_dict()  # tensors share storage with `padded`
    for name, t in new.items():
        if name in old and old[name].shape == t.shape:
            t.copy_(old[name])  # embeddings, norms, attention, unchanged MLPs
        elif name in old and name.endswith(("gate_proj.weight", "up_proj.weight")):
            t[:I0].copy_(old[name])  # extra rows: random, inert (see down_proj)
        elif name in old and name.endswith("down_proj.weight"):
            t.zero_()
            t[:, :I0].copy_(old[name])  # extra columns zero: extra units are dropped
        elif name in old:
            raise ValueError(f"unexpected shape change for {name}")
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()  # new layer: both sub-blocks add 0 to the residual stream
    padded.generation_config = copy.deepcopy(model.generation_config)
    padded.eval()
    return padded


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--min-params", type=int, default=100_000_000)
    ap.add_argument("--layers", type=int, default=None, help="total depth (default: 2x source)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    src = AutoModelForCausalLM.from_pretrained(a.src, dtype=torch.float32).eval()
    padded = pad_model(src, a.min_params, a.layers, a.seed)
    # Sanity check in fp32 before casting: the function must be unchanged.
    x = torch.randint(0, src.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (src(input_ids=x).logits - padded(input_ids=x).logits).abs().max().item()
    padded.to(getattr(torch, a.dtype)).save_pretrained(a.dst)
    for f in a.src.iterdir():  # tokenizer files travel with the model
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, a.dst / f.name)
    c = padded.config
    print(f"{a.src} ({n_params(src):,} params) -> {a.dst} ({n_params(padded):,} params): "
          f"{c.num_hidden_layers} layers, intermediate {c.intermediate_size}, "
          f"max |logit diff| fp32 = {diff:.2e}")


if __name__ == "__main__":
    main()

"""Random-initialised model pairs with a real model's shapes and a forced
acceptance, for measuring cost rather than quality.

A random drafter almost never agrees with a random target, so speculation on
such a pair measures only rejected drafts. Here both models are made to predict
the token they read: every attention output and MLP down projection is zeroed
(the residual stream stays the token's embedding) and the LM head is the
embedding table, so the largest logit is the input token itself (for random
embeddings of width C its score is ~C, any other's ~sqrt(C)). The drafter then
proposes exactly what the target will choose, every draft is accepted under
greedy, and each forward still does all of the real shapes' arithmetic (zero
weights cost what any weights cost). The reports say so wherever they use it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# Zeroed so that each block adds nothing to the residual stream: the output
# projection of attention and of the MLP, by their names across the families.
_OUTPUT_PROJECTIONS = ("o_proj", "down_proj")


@torch.no_grad()
def force_copying(model) -> None:
    """Make `model` predict its input token (see the module docstring)."""
    for name, p in model.named_parameters():
        if any(f".{proj}." in f".{name}" for proj in _OUTPUT_PROJECTIONS):
            p.zero_()
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if head.data_ptr() != embed.data_ptr():
        head.copy_(embed)


def build(config, out_dir: Path, tokenizer_dir: Path, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """Build (once; cached by config) a random-init model from `config` on
    `device`, force it to copy, and save it with the tokenizer of
    `tokenizer_dir`, loadable like a user's checkpoint."""
    stamp = out_dir / "synthetic.json"
    want = {"config": config.to_diff_dict(), "dtype": str(dtype), "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    torch.manual_seed(seed)
    with torch.device(device):  # built where it runs: an 8B model's init on a CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    force_copying(model)
    model.save_pretrained(out_dir)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json", "merges.txt"):
            shutil.copy(f, out_dir / f.name)
    stamp.write_text(json.dumps(want))
    del model
    return out_dir

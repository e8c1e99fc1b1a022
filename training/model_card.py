"""Write models/demo/MODEL_CARD.md from build_info.json (written by
build_demo_pair) and eval.json (written by evaluate_pair).

    python -m training.model_card models/demo [--wall-minutes N]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

BARS = {"greedy_tokens_per_cycle": 3.0, "greedy_acceptance": 0.6, "sampling_acceptance": 0.5}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores visible"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def _ok(value: float, bar: float) -> str:
    return "met" if value >= bar else "NOT met"


def _arch_row(name: str, m: dict) -> str:
    c = m["config"]
    return (f"| {name} | {c['hidden_size']} | {c['num_hidden_layers']} | {c['num_attention_heads']} "
            f"| {c['intermediate_size']} | {c['vocab_size']} | {c['max_position_embeddings']} "
            f"| {m['params']:,} |")


def _size_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 1e6


def render(pair: Path, wall_minutes: float | None) -> str:
    info = json.loads((pair / "build_info.json").read_text())
    ev = json.loads((pair / "eval.json").read_text())
    t, d, cs = info["target"], info["drafter"], info["corpus"]
    ta, da = t["args"], d["args"]
    g, s = ev["greedy"], ev["sampling"]
    epochs_t = t["tokens_seen"] / cs["train"]["tokens"]
    epochs_d = d["tokens_seen"] / cs["train"]["tokens"]
    train_minutes = t["minutes"] + d["minutes"]
    wall = f"{wall_minutes:.0f} min" if wall_minutes is not None else "n/a"
    return f"""# specd demo model pair (target + drafter)

A tiny target/drafter pair for demonstrating and testing speculative decoding
end to end on CPU. Both are `LlamaForCausalLM` models trained **from scratch**
on Python source code, sharing one byte-level BPE tokenizer. They are toys: the
point is a realistic *acceptance* behaviour (the drafter is distilled from the
target), not useful code generation.

| path | contents |
|---|---|
| `target/` | target model (config.json, model.safetensors in fp16, tokenizer files) |
| `drafter/` | drafter model (same layout, same tokenizer) |
| `build_info.json` | raw training record (configs, arguments, loss history) |
| `eval.json` | raw held-out acceptance figures |

Load with `AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)` and
`AutoTokenizer.from_pretrained(dir)`. Folder size: {_size_mb(pair):.1f} MB.

## Data

* Corpus: the `.py` files of the CPython {info['python']} standard library
  (`sysconfig.get_paths()["stdlib"]`), present on every machine without a
  download. Excluded: `site-packages` (differs per machine) and the test
  directories `test/`, `tests/`, `idle_test/` (over half the bytes, mostly
  repetitive assertions). Files are read as UTF-8 with replacement.
  Another Python version gives a slightly different corpus.
* Split **by file**: a file is held out iff the first 4 bytes of
  sha1(path relative to the stdlib root), as a big-endian integer, are
  ≡ 0 mod 20 (about 5 %). No window of a held-out file is ever trained on.
* Files are concatenated as `<|endoftext|> file <|endoftext|> file ...`.

| split | files | bytes | tokens |
|---|---|---|---|
| train | {cs['train']['files']} | {cs['train']['bytes']:,} | {cs['train']['tokens']:,} |
| held-out | {cs['heldout']['files']} | {cs['heldout']['bytes']:,} | {cs['heldout']['tokens']:,} |

* Tokenizer: byte-level BPE (HF `tokenizers`, GPT-2 style ByteLevel
  pre-tokenizer/decoder, so any text round-trips), vocabulary 4,096 trained on
  the train split only; `<|endoftext|>` (id 0) is bos/eos/pad/unk.

## Architectures

Both: Llama, tied input/output embeddings, no biases, RoPE θ = 10,000, SiLU MLP.

| model | hidden | layers | heads | intermediate | vocab | max positions | parameters |
|---|---|---|---|---|---|---|---|
{_arch_row('target', t)}
{_arch_row('drafter', d)}

The drafter has 1/{t['params'] / d['params']:.2f} of the target's parameters.

## Training

Seeds fixed (torch seed 0 for the target, 1 for the drafter; numpy sampler seed
0). Random windows of {ta['seq_len']} tokens, batch {ta['batch']}, AdamW
(β = 0.9, 0.95, weight decay {ta['weight_decay']} on matrices), gradient clipping
1.0, {ta['warmup_steps']} warm-up steps then cosine decay to {ta['min_lr_frac']:g}× the peak LR.
Runs were wall-clock budgeted: the cosine follows elapsed / budget, and the
step counts below are what fitted.

| | target | drafter |
|---|---|---|
| objective | next-token cross-entropy | {da['kd_alpha']:g} × KL(target ‖ drafter) at τ = {da['kd_temperature']:g} + {1 - da['kd_alpha']:.2g} × corpus CE; target frozen, logits on the fly |
| peak LR | {ta['lr']:g} | {da['lr']:g} |
| steps | {t['steps']:,} | {d['steps']:,} |
| tokens seen | {t['tokens_seen']:,} ({epochs_t:.2f} epochs) | {d['tokens_seen']:,} ({epochs_d:.2f} epochs) |
| wall time | {t['minutes']:.1f} min | {d['minutes']:.1f} min |
| final train loss (EMA) | {t['train_loss_ema']:.3f} | {d['train_loss_ema']:.3f} (mixed objective) |
| held-out CE, fp32 at end of training | {t['final']['heldout_ce']:.3f} | {d['final']['heldout_ce']:.3f} (KL to target {d['final']['heldout_kl']:.3f}) |
| held-out CE, saved fp16 weights | {ev['heldout_ce']['target']:.3f} | {ev['heldout_ce']['drafter']:.3f} |

Cross-entropies are nats/token on 128 fixed windows of 256 held-out tokens.
The drafter is distilled from the *saved* (fp16-rounded) target, i.e. the model
that is served.

Machine: {info['machine']}, {_cpu()}, {info['torch_threads']} torch threads,
torch {info['torch']}, shared with other jobs while training. Training took
{train_minutes:.0f} min; the whole pipeline (tokenizer, training, evaluation,
card) {wall}.

## Held-out acceptance (from `python -m training.evaluate_pair`)

{ev['setup']['prompts']} prompts of {ev['setup']['prompt_len']} tokens from held-out files at fixed
offsets (files round-robin, offsets spread over each file); {ev['setup']['new_tokens']} new tokens each; K = {ev['setup']['k']}.

| measure | value | bar |
|---|---|---|
| greedy: mean tokens committed per cycle (bonus included) | **{g['mean_tokens_per_cycle']:.2f}** | ≥ {BARS['greedy_tokens_per_cycle']} ({_ok(g['mean_tokens_per_cycle'], BARS['greedy_tokens_per_cycle'])}) |
| greedy: per-token acceptance (accepted / drafted) | **{g['per_token_acceptance']:.3f}** | ≥ {BARS['greedy_acceptance']} ({_ok(g['per_token_acceptance'], BARS['greedy_acceptance'])}) |
| greedy: conditional per-token acceptance α (accepted / judged) | {g['per_token_acceptance_conditional']:.3f} | (see note) |
| T = {s['temperature']}: per-token acceptance Σ min(p, q), along target-sampled continuations | **{s['per_token_acceptance_on_target_samples']:.3f}** | ≥ {BARS['sampling_acceptance']} ({_ok(s['per_token_acceptance_on_target_samples'], BARS['sampling_acceptance'])}) |
| T = {s['temperature']}: same, along held-out text | {s['per_token_acceptance_on_heldout_text']:.3f} | |
| T = {s['temperature']}: implied tokens per cycle, (1 − α^(K+1)) / (1 − α) | {s['expected_tokens_per_cycle_iid_estimate']:.2f} | (estimate, assumes i.i.d. acceptance) |

Greedy figures are an exact replay of propose/verify cycles: the target's
greedy continuation is generated once (KV cache); at each committed position the
drafter greedily proposes K tokens from the committed prefix, the matching
prefix is accepted and the cycle commits accepted + 1 tokens
({g['cycles']} cycles, {g['tokens_committed']} tokens). "accepted / drafted"
counts the drafts thrown away after the first mismatch of a cycle as failures,
so it equals (tokens per cycle − 1) / K; "accepted / judged" leaves them out and
is the α of the DESIGN formula (1 − α^(K+1)) / (1 − α), the figure comparable
with the sampling acceptance below. Note that accepted / drafted ≥ 0.6 implies
≥ 4 tokens per cycle at K = 5, a stricter bar than ≥ 3 tokens per cycle. Sampling figures are
the speculative-sampling acceptance probability Σ_x min(p(x), q(x)) with
p, q = softmax(logits / T) of target and drafter, averaged over positions.

**Caveat — greedy figures flatter the pair.** A 7 M-parameter target trained for
about one epoch often falls into repetition loops under greedy decoding (e.g. a
list literal repeating the same item), and loops are easy to draft: the greedy
continuations have a distinct-4-gram fraction of {g['distinct_4gram_fraction']:.2f}
versus {s['distinct_4gram_fraction']:.2f} for the T = {s['temperature']} samples. The sampling acceptance (on samples and on real held-out text) is the more
representative figure of how close the drafter is to the target. Also note the
drafter's held-out CE is about the target's: the target is under-trained for its
size, and distillation transfers most of what it learned.

## Reproduce

Rebuild the pair (tokenizer → target → drafter → evaluation → this card):

```
bash training/run_all.sh   # this build, then the evaluation and card commands below
python -m training.build_demo_pair --out models/demo --target-minutes {ta['minutes']:g} --drafter-minutes {da['minutes']:g}
```

The time budget makes the step count machine-dependent; to pin the step counts
of this build use
`python -m training.build_demo_pair --out models/demo --target-steps {t['steps']} --drafter-steps {d['steps']}`
(same data order and seeds; the LR then follows step / steps instead of the
wall clock, so the result is close to, not bit-identical with, this build).

Reproduce the figures above, then this card:

```
python -m training.evaluate_pair models/demo
python -m training.model_card models/demo
```

Cost-scaled target for benchmarks (≥ 100 M parameters, identical logits; not
committed, build it when needed):

```
python -m training.pad_target models/demo/target /tmp/target-100m --min-params 100000000
```
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("pair", type=Path)
    ap.add_argument("--wall-minutes", type=float, default=None)
    a = ap.parse_args(argv)
    (a.pair / "MODEL_CARD.md").write_text(render(a.pair, a.wall_minutes))
    print(f"wrote {a.pair / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()

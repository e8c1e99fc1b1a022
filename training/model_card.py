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


def cpu() -> str:
    """This machine's processor (build_demo_pair records it with the training run:
    the card names the machine the pair was trained on, not the one rendering it)."""
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


def _eagle_row(pair: Path) -> str:
    if not (pair / "eagle" / "train_info.json").exists():
        return ""
    return ("\n| `eagle/` | EAGLE draft head for the target (config.json, model.safetensors in fp16, "
            "train_info.json); see below |")


def _eagle_section(pair: Path) -> str:
    """The EAGLE head (training/eagle.py) and, when benchmarks/eagle.py has
    run, its held-out acceptance next to the drafter's."""
    d = pair / "eagle"
    if not (d / "train_info.json").exists():
        return ""
    info = json.loads((d / "train_info.json").read_text())
    cfg = json.loads((d / "config.json").read_text())
    a, fin = info["args"], info["final_heldout"]
    levels = int(a.get("levels", 1))
    sfx = [""] + [f"_{i + 1}" for i in range(1, levels)]
    per_level = "\n".join(f"| {i + 1} | {fin['top1' + s]:.3f} | {fin['ce' + s]:.3f} | {fin['reg' + s]:.3f} |"
                          for i, s in enumerate(sfx))
    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file()) / 1e6
    from safetensors.torch import load_file
    n_params = sum(t.numel() for t in load_file(str(d / "model.safetensors")).values())
    bench = Path(__file__).resolve().parents[1] / "benchmarks/results/eagle.json"
    table = ""
    if bench.exists():
        b = json.loads(bench.read_text())
        st = b["setup"]
        rows = "\n".join(
            f"| {label} | {r['draft_model']['mean_accepted_length']:.2f} | {r['eagle']['mean_accepted_length']:.2f} "
            f"| {r['eagle'].get('feature_bytes_per_cycle', 0):.0f} |"
            for label, r in b["results"].items() if "eagle" in r)
        deep = max((k for k in b["results"] if k.startswith("chain-")), key=lambda k: int(k[6:]))
        table = f"""
Held-out acceptance (`python -m benchmarks.eagle`, {st['prompts']} held-out prompts of
{st['prompt_tokens']} tokens, {st['max_new_tokens']} new tokens, greedy, fixed K, through the
services; mean tokens committed per verify, bonus included):

| draft | drafter (distilled) | EAGLE head | features per cycle (bytes) |
|---|---|---|---|
{rows}

On the held-out windows above, the distilled drafter's teacher-forced top-1 agreement
with the target is {b['teacher_forced_top1']['draft_model']:.3f} (the same at every level: it reads tokens only).
Share of cycles whose kept path reached each draft position ({deep}):
drafter {b['results'][deep]['draft_model']['acceptance_per_position']},
head {b['results'][deep]['eagle']['acceptance_per_position']}.

Reading: the head and the distilled drafter end up about even (8 prompts: differences
of a few hundredths are within noise). The head is weaker at the first draft position
(0.92 M parameters in one layer, trained 36 min on one shared thread on 2.5 M tokens;
the drafter has three layers and was trained on 3.9 M tokens with two threads) and
stronger at the next two, where it drafts on its own features: the unrolled training
keeps its agreement nearly flat with depth. EAGLE reports its gains on 7 B+ targets;
a plausible reason the gain is small here (not measured) is that this 8-layer,
256-wide target's top feature adds little over its tokens, and its greedy text is
repetitive, which a token-level drafter copies well.
"""
    return f"""
## EAGLE draft head (`eagle/`)

A draft head in the style of EAGLE (Li et al. 2024) for method `eagle`: one Llama
decoder layer (hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, intermediate
{cfg['intermediate_size']}) over `fc([embed(x_t+1); f_t])`, where `f_t` is the target's
last-layer hidden state before the final norm; it predicts `f_t+1`, and the target's
own final norm and LM head give the draft distribution. The head ships only `fc` and
its layer ({n_params / 1e6:.2f} M parameters, fp16, {size:.1f} MB); the embedding, norm
and LM head are read from `{cfg.get('target', '../target')}` (relative to the head).

Training (`python -m training.eagle`, specd_core/runtime/eagle_head.py for the module): the
train split above (never the held-out files), random windows of {a['seq_len']} tokens,
batch {a['batch']}; features from the frozen fp32 target on the fly. Loss per draft
level: smooth-L1 to the target's next feature + {a['w_cls']} × cross-entropy to the
target's next-token distribution; inputs noised by ±{a['noise']} × feature RMS
(EAGLE's augmentation); the draft unrolled {levels} levels deep with the attention a
draft node of that depth has (EAGLE-3's training-time test), so levels 2+ run on the
head's own predicted features. AdamW, peak LR {a['lr']}, cosine to 0.1×, wall-clock
budget {a['minutes']} min on {a['threads']} thread (shared machine): {info['steps']} steps,
{info['tokens_seen']:,} tokens ({info['tokens_seen'] / 3320801:.2f} epochs), {info['minutes']:.1f} min,
final train loss (EMA) {info['train_loss_ema']:.3f}.

Held-out (16 windows of {a['seq_len']} held-out tokens, tokens teacher-forced; level 1 reads the
target's features, level d the head's own features of d − 1 drafted positions):

| draft level | top-1 agreement with the target | CE to the target (nats) | feature smooth-L1 |
|---|---|---|---|
{per_level}
{table}"""


def _published_rows(pair: Path) -> str:
    rows = {"eagle3": "EAGLE-3 head in the published format (config.json, model.safetensors in fp16, train_info.json)",
            "medusa": "Medusa heads in the Medusa authors' layout (config.json, medusa_lm_head.safetensors in fp16, "
                      "train_info.json)"}
    return "".join(f"\n| `{k}/` | {v}; see below |" for k, v in rows.items() if (pair / k / "train_info.json").exists())


def _published_section(pair: Path) -> str:
    """The EAGLE-3 and Medusa heads (training/eagle3.py, training/medusa.py):
    their training and held-out agreement; the served comparison is in
    benchmarks/README.md (benchmarks/heads.py)."""
    e3, md = pair / "eagle3", pair / "medusa"
    if not ((e3 / "train_info.json").exists() and (md / "train_info.json").exists()):
        return ""
    ei, mi = (json.loads((d / "train_info.json").read_text()) for d in (e3, md))
    ec, mc = (json.loads((d / "config.json").read_text()) for d in (e3, md))
    ef, mf = ei["final_heldout"], mi["final_heldout"]
    levels = "\n".join(f"| {d} | {ef[f'top1_{d}']:.3f} | {ef[f'ce{d}']:.3f} |" for d in range(1, 4))
    heads = "\n".join(f"| {i} | t + {i + 2} | {mf[f'top1_{i}']:.3f} | {mf[f'ce{i}']:.3f} |"
                       for i in range(mc["medusa_num_heads"]))
    aux = ec["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return f"""
## EAGLE-3 head (`eagle3/`) and Medusa heads (`medusa/`), in the published formats

Both are saved as their authors publish them, so they load the way downloaded heads
do (`specd up --method eagle3 --drafter models/demo/eagle3`, `--method medusa
--drafter models/demo/medusa`). Trained on the train split above, random windows of
{ei['args']['seq_len']} tokens, batch {ei['args']['batch']}, the frozen fp32 target's
hidden states and next-token distributions on the fly (soft labels), AdamW, cosine to
0.1x, one thread each, the two runs side by side on the 2-core machine.

EAGLE-3 (`python -m training.eagle3`): `fc` over the target's layers {aux}
(the published default (2, L // 2, L - 3)), one decoder layer reading
[embedding; hidden state], `norm` and an LM head over a draft vocabulary of the
{ec['draft_vocab_size']} most frequent training tokens of the target's {ec['vocab_size']}
({ei['draft_vocab_coverage']:.1%} of the training tokens), `d2t` / `t2d` mapping it to
target ids; no embedding shipped (the target's is read). Loss: cross-entropy to the
target's distribution on the draft vocabulary, the draft unrolled
{ei['args']['levels']} levels deep on the head's own outputs (EAGLE-3's training-time
test). Peak LR {ei['args']['lr']:g}, {ei['steps']} steps in {ei['minutes']:.1f} min.
Held-out (16 windows, tokens teacher-forced):

| draft level | top-1 agreement with the target | CE to the target on the draft vocabulary (nats) |
|---|---|---|
{levels}

Medusa (`python -m training.medusa`): {mc['medusa_num_heads']} heads of
{mc['medusa_num_layers']} residual block each on the target's last hidden state after
its final norm, blocks starting at the identity and LM heads at the target's (as
Medusa does); loss: cross-entropy to the target's distribution at each head's offset,
head i weighted 0.8^i. Peak LR {mi['args']['lr']:g}, {mi['steps']} steps in
{mi['minutes']:.1f} min. Held-out:

| head | predicts | top-1 agreement with the target | CE to the target (nats) |
|---|---|---|---|
{heads}

Served against the distilled drafter and the EAGLE head above:
`python -m benchmarks.heads` (benchmarks/README.md, "Draft heads trained here").
"""


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
| `bench_prompts.jsonl` | `specd bench`'s default prompts: 16 held-out prompts of 96 tokens, ids and text |{_eagle_row(pair)}{_published_rows(pair)}

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

Machine: {info['machine']}, {info.get('cpu') or cpu()}, {info['torch_threads']} torch threads,
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
is the α of the formula (1 − α^(K+1)) / (1 − α) (docs/rules.md), the figure comparable
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
{_eagle_section(pair)}{_published_section(pair)}
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

EAGLE head (about 36 min on one thread), its benchmark, then this card:

```
python -m training.eagle --target models/demo/target --out models/demo/eagle --minutes 36
python -m benchmarks.eagle
python -m training.model_card models/demo --wall-minutes 65
```

EAGLE-3 and Medusa heads (30 min each, one thread each, side by side), their
benchmark, then this card:

```
python -m training.eagle3 --minutes 30 & python -m training.medusa --minutes 30; wait
python -m benchmarks.heads
python -m training.model_card models/demo --wall-minutes 65
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

"""Measure the demo pair's speculative-decoding acceptance on HELD-OUT files.

    python -m training.evaluate_pair models/demo [--prompts 40 --k 5]

Greedy (exact simulation): for each prompt the target's greedy continuation is
generated once (KV cache). Then speculative cycles are replayed: at committed
length c the drafter greedily proposes K tokens from the committed prefix; the
accepted count is the length of the prefix that matches the target's greedy
continuation, and the cycle commits accepted + 1 tokens (the verifier's bonus /
correction token). For greedy decoding this is exactly what a real
propose/verify loop produces, without needing one.

Sampling (T = 0.8): per-token acceptance of speculative sampling is
sum_x min(p(x), q(x)) with p, q the target and drafter softmax(logits / T); it is
averaged over the positions of target-SAMPLED continuations of the same prompts
(the distribution the server actually sees) and, as a second figure, over the
positions of held-out text itself.

Results go to stdout and OUT/eval.json (read by training.model_card).
"""
from __future__ import annotations

import os

# Must precede the torch import: with libgomp's default busy-waiting, two intra-op
# threads on a shared 2-core box lose ~3x throughput when another process runs
# (measured 818 vs 2,121 tok/s training the target); passive waiting avoids it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from . import corpus
from .train import evaluate_ce, heldout_windows


def make_prompts(tokenizer, n: int, length: int, min_room: int) -> list[torch.Tensor]:
    """n prompts of `length` tokens from held-out files, at fixed offsets.

    Files are taken round-robin (sorted by path); the r-th visit of a file uses
    the offset at fraction (r + 1) / (visits + 1) of its usable span, so prompts
    spread over each file and the set is identical on every run.
    """
    files = corpus.split_files()["heldout"]
    arrays = [a for a in corpus.file_token_arrays(tokenizer, files) if len(a) >= length + min_room]
    visits = -(-n // len(arrays))
    prompts = []
    for i in range(n):
        arr, r = arrays[i % len(arrays)], i // len(arrays)
        span = len(arr) - length - min_room
        off = span * (r + 1) // (visits + 1)
        prompts.append(torch.from_numpy(arr[off : off + length].copy()))
    return prompts


@torch.no_grad()
def continue_with_cache(model, prompt: torch.Tensor, n: int, temperature: float = 0.0,
                        gen: torch.Generator | None = None) -> torch.Tensor:
    """n tokens after `prompt` from `model` (greedy if temperature == 0), KV-cached."""
    out = model(input_ids=prompt[None], use_cache=True)
    cache, logits, toks = out.cache, out.logits[0, -1], []
    for _ in range(n):
        if temperature == 0.0:
            nxt = int(logits.argmax())
        else:
            probs = F.softmax(logits.float() / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        toks.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[0, -1]
    return torch.tensor(toks, dtype=torch.long)


@torch.no_grad()
def draft_greedy(drafter, prefix: torch.Tensor, k: int) -> list[int]:
    """K greedy drafter tokens after `prefix`. No cache: at these sizes a full
    forward costs a few ms and makes the simulation trivially exact."""
    seq, out = prefix.clone(), []
    for _ in range(k):
        nxt = int(drafter(input_ids=seq[None]).logits[0, -1].argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    return out


def simulate_greedy(drafter, prompt, cont, n_commit: int, k: int) -> tuple[int, int, int]:
    """Replay cycles until n_commit continuation tokens are committed.

    `cont` must hold at least n_commit + k + 1 target-greedy tokens so every
    cycle is complete. Returns (cycles, accepted draft tokens, rejected draft
    tokens); a cycle rejects at most one draft (the first mismatch), the drafts
    after it are discarded unjudged.
    """
    c = cycles = accepted = rejected = 0
    while c < n_commit:
        draft = draft_greedy(drafter, torch.cat([prompt, cont[:c]]), k)
        a = 0
        while a < k and draft[a] == int(cont[c + a]):
            a += 1
        cycles, accepted, rejected, c = cycles + 1, accepted + a, rejected + (a < k), c + a + 1
    return cycles, accepted, rejected


@torch.no_grad()
def overlap(target, drafter, seq: torch.Tensor, start: int, temperature: float) -> torch.Tensor:
    """sum_x min(p, q) at every position predicting seq[start:]."""
    p = F.softmax(target(input_ids=seq[None]).logits[0, start - 1 : -1].float() / temperature, -1)
    q = F.softmax(drafter(input_ids=seq[None]).logits[0, start - 1 : -1].float() / temperature, -1)
    return torch.minimum(p, q).sum(-1)


def distinct_4grams(toks: torch.Tensor) -> float:
    """Unique / total 4-grams: ~1 for natural text, low for a repetition loop."""
    grams = [tuple(toks[i : i + 4].tolist()) for i in range(len(toks) - 3)]
    return len(set(grams)) / len(grams)


def load(path: Path):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.eval()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", type=Path, help="directory holding target/ and drafter/")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()

    tokenizer = AutoTokenizer.from_pretrained(a.pair / "target")
    target, drafter = load(a.pair / "target"), load(a.pair / "drafter")
    n_gen = a.new_tokens + a.k + 1  # room for the last cycle's drafts + bonus
    prompts = make_prompts(tokenizer, a.prompts, a.prompt_len, n_gen)

    # Greedy, exact replay.
    cycles = acc = rej = 0
    distinct = []
    for p in prompts:
        cont = continue_with_cache(target, p, n_gen)
        distinct.append(distinct_4grams(cont[: a.new_tokens]))
        c, ac, rj = simulate_greedy(drafter, p, cont, a.new_tokens, a.k)
        cycles, acc, rej = cycles + c, acc + ac, rej + rj
    committed = acc + cycles  # accepted drafts + one bonus/correction per cycle
    greedy = {"cycles": cycles, "tokens_committed": committed,
              "mean_tokens_per_cycle": committed / cycles,
              # accepted / drafted: counts the drafts discarded after a mismatch.
              "per_token_acceptance": acc / (cycles * a.k),
              # accepted / judged: the rate alpha of (1 - a^(K+1)) / (1 - a), i.e.
              # P(draft accepted | all earlier drafts of the cycle accepted).
              "per_token_acceptance_conditional": acc / (acc + rej),
              # Small greedy models loop; loops are easy to draft (see model card).
              "distinct_4gram_fraction": float(np.mean(distinct))}

    # Sampling at temperature T: overlap along target-sampled continuations.
    gen = torch.Generator().manual_seed(a.seed)
    ov_sampled, distinct_s = [], []
    for p in prompts:
        cont = continue_with_cache(target, p, a.new_tokens, a.temperature, gen)
        distinct_s.append(distinct_4grams(cont))
        ov_sampled.append(overlap(target, drafter, torch.cat([p, cont]), len(p), a.temperature))
    alpha_s = float(torch.cat(ov_sampled).mean())
    # Same measure along the held-out text itself (prompt + the true next tokens).
    ov_text = []
    stream = heldout_stream(tokenizer)
    for w in heldout_windows(stream, 256, 32):
        ov_text.append(overlap(target, drafter, w, 1, a.temperature))
    alpha_t = float(torch.cat(ov_text).mean())
    k = a.k
    sampling = {"temperature": a.temperature,
                "per_token_acceptance_on_target_samples": alpha_s,
                "per_token_acceptance_on_heldout_text": alpha_t,
                "distinct_4gram_fraction": float(np.mean(distinct_s)),
                # Expected tokens/cycle if acceptances were i.i.d. with rate alpha.
                "expected_tokens_per_cycle_iid_estimate": (1 - alpha_s ** (k + 1)) / (1 - alpha_s)}

    # Held-out cross-entropy of the weights as saved (fp16 -> fp32).
    heldout = heldout_windows(stream, 256, 128)
    res = {
        "setup": {"prompts": a.prompts, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                  "k": k, "seed": a.seed, "prompt_source": "held-out files, fixed offsets"},
        "greedy": greedy, "sampling": sampling,
        "heldout_ce": {"target": evaluate_ce(target, heldout), "drafter": evaluate_ce(drafter, heldout)},
        "eval_seconds": time.time() - t0,
    }
    print(json.dumps(res, indent=2))
    (a.pair / "eval.json").write_text(json.dumps(res, indent=2))


def heldout_stream(tokenizer) -> np.ndarray:
    """All held-out files as one token stream, `<|endoftext|> file ...` as in training."""
    eot = np.array([tokenizer.eos_token_id])
    parts = []
    for arr in corpus.file_token_arrays(tokenizer, corpus.split_files()["heldout"]):
        parts += [eot, arr]
    return np.concatenate(parts)


if __name__ == "__main__":
    main()

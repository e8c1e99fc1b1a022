"""Build the demo pair from scratch: tokenizer -> target -> distilled drafter.

    python -m training.build_demo_pair --out models/demo \
        --target-minutes 40 --drafter-minutes 25      # time-budgeted
    python -m training.build_demo_pair --out models/demo \
        --target-steps N --drafter-steps M            # exact replay

Seeds are fixed (torch, numpy data sampler). Intermediate state lives in
training/.cache (tokenized corpus, resumable checkpoints); the log goes to
training/logs/. The final models are saved in fp16 (Hugging Face format) with
the tokenizer copied into both directories, plus build_info.json that the
model card is generated from.
"""
from __future__ import annotations

import os

# Must precede the torch import: with libgomp's default busy-waiting, two intra-op
# threads on a shared 2-core box lose ~3x throughput when another process runs
# (measured 818 vs 2,121 tok/s training the target); passive waiting avoids it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from . import corpus, model_card, models, train

HERE = Path(__file__).resolve().parent


def _logger(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = path.open("a")

    def log(msg: str):
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        fh.write(line + "\n")
        fh.flush()

    return log


def save_model(model, tok_dir: Path, out: Path):
    """fp16 safetensors + config + tokenizer files, loadable with Auto* classes."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out)
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)


def load_fp32(path: Path):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.eval()
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models/demo"))
    ap.add_argument("--cache", type=Path, default=HERE / ".cache")
    ap.add_argument("--log", type=Path, default=HERE / "logs" / "build_demo_pair.log")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--target-minutes", type=float)
    g.add_argument("--target-steps", type=int)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--drafter-minutes", type=float)
    g.add_argument("--drafter-steps", type=int)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--drafter-lr", type=float, default=3e-3)
    ap.add_argument("--kd-temperature", type=float, default=1.0)
    ap.add_argument("--kd-alpha", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-target", action="store_true",
                    help="reuse an already built OUT/target (e.g. to redo only the drafter)")
    a = ap.parse_args(argv)
    if a.target_minutes is None and a.target_steps is None:
        a.target_minutes = 40.0
    if a.drafter_minutes is None and a.drafter_steps is None:
        a.drafter_minutes = 25.0

    torch.set_num_threads(a.threads)
    a.cache.mkdir(parents=True, exist_ok=True)
    log = _logger(a.log)
    t_start = time.time()
    log(f"build_demo_pair {vars(a)}")

    tokenizer, tok_dir, corpus_stats = corpus.prepare(a.cache, log)
    train_tokens = np.load(a.cache / "train.u16.npy")
    heldout = train.heldout_windows(np.load(a.cache / "heldout.u16.npy"), a.seq_len, 128)
    vocab, eot = len(tokenizer), tokenizer.eos_token_id
    info_path = a.out / "build_info.json"
    info = json.loads(info_path.read_text()) if (a.skip_target and info_path.exists()) else {}
    info.update(corpus=corpus_stats, python=platform.python_version(),
                machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                cpu=model_card.cpu(),
                torch_threads=a.threads, torch=torch.__version__)

    def targs(steps, minutes, lr, **kw):
        return train.TrainArgs(seq_len=a.seq_len, batch=a.batch, lr=lr, steps=steps,
                               minutes=minutes, seed=a.seed, **kw)

    # --- target -----------------------------------------------------------
    if not a.skip_target:
        torch.manual_seed(a.seed)
        target = models.build(models.target_config(vocab, eot))
        log(f"[target] params {models.n_params(target):,}")
        res = train.run(target, train_tokens, heldout,
                        targs(a.target_steps, a.target_minutes, a.target_lr),
                        a.cache / "ckpt_target.pt", lambda m: log("[target] " + m))
        save_model(target, tok_dir, a.out / "target")
        info["target"] = dict(res, params=models.n_params(target),
                              config=models.target_config(vocab, eot).to_diff_dict())
        info_path.parent.mkdir(parents=True, exist_ok=True)
        info_path.write_text(json.dumps(info, indent=2))
        log(f"[target] saved, {res['steps']} steps, {res['minutes']:.1f} min")

    # --- drafter, distilled from the target exactly as it is served (fp16 weights) ---
    teacher = load_fp32(a.out / "target")
    for p in teacher.parameters():
        p.requires_grad_(False)
    torch.manual_seed(a.seed + 1)
    drafter = models.build(models.drafter_config(vocab, eot))
    log(f"[drafter] params {models.n_params(drafter):,}")
    res = train.run(drafter, train_tokens, heldout,
                    targs(a.drafter_steps, a.drafter_minutes, a.drafter_lr,
                          kd_temperature=a.kd_temperature, kd_alpha=a.kd_alpha),
                    a.cache / "ckpt_drafter.pt", lambda m: log("[drafter] " + m), teacher=teacher)
    save_model(drafter, tok_dir, a.out / "drafter")
    info["drafter"] = dict(res, params=models.n_params(drafter),
                           config=models.drafter_config(vocab, eot).to_diff_dict())
    info["build_minutes_this_run"] = (time.time() - t_start) / 60
    info_path.write_text(json.dumps(info, indent=2))
    # Checkpoints are only for crash recovery within one build.
    for name in ("ckpt_target.pt", "ckpt_drafter.pt"):
        (a.cache / name).unlink(missing_ok=True)
    log(f"[drafter] saved, {res['steps']} steps, {res['minutes']:.1f} min; done")


if __name__ == "__main__":
    main()

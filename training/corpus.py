"""Corpus, split and tokenizer for the demo pair.

The corpus is the running interpreter's standard library (`*.py` under
sysconfig's "stdlib" path): it exists on every machine that can run the project,
needs no download, and is code, which is what the demo serves.

Choices (documented in the model card too):
  * site-packages is excluded: it differs from machine to machine.
  * test directories (`test`, `tests`, `idle_test`) are excluded: they are ~60 %
    of the bytes, mostly repetitive assert boilerplate, and we cannot even train on
    the rest for a full epoch in the CPU time budget.
  * the held-out split is by FILE, decided by a hash of the path relative to the
    stdlib root, so it is stable across machines and runs and no held-out file
    leaks into training through overlapping windows.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
HELDOUT_MOD = 20  # 1 file in 20 (~5 %) is held out
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """Deterministic per-file split: sha1 of the POSIX relative path."""
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % HELDOUT_MOD == 0


def list_files() -> list[tuple[str, Path]]:
    """(relative posix path, absolute path) of every corpus file, sorted."""
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                out.append((path.relative_to(root).as_posix(), path))
    out.sort()
    return out


def read_text(path: Path) -> str:
    # A few stdlib files are latin-1 or contain stray bytes; replacement keeps
    # the pipeline deterministic instead of dropping files.
    return path.read_bytes().decode("utf-8", errors="replace")


def split_files() -> dict[str, list[tuple[str, Path]]]:
    files = list_files()
    return {
        "train": [f for f in files if not is_heldout(f[0])],
        "heldout": [f for f in files if is_heldout(f[0])],
    }


def train_tokenizer(train_files: list[tuple[str, Path]], out_dir: Path):
    """Byte-level BPE (GPT-2 style) so that any text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOT],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(p) for _, p in train_files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT
    )
    fast.model_max_length = 1024
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def encode_files(tokenizer, files: list[tuple[str, Path]]) -> np.ndarray:
    """Concatenate files as `<|endoftext|> file <|endoftext|> file ...` in uint16."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    texts = [read_text(p) for _, p in files]
    ids = tokenizer.backend_tokenizer.encode_batch(texts)
    parts = []
    for enc in ids:
        parts.append(np.array([eot], dtype=np.uint16))
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
    return np.concatenate(parts)


def file_token_arrays(tokenizer, files: list[tuple[str, Path]]) -> list[np.ndarray]:
    """Per-file token arrays (used by the evaluation to draw prompts)."""
    encs = tokenizer.backend_tokenizer.encode_batch([read_text(p) for _, p in files])
    return [np.asarray(e.ids, dtype=np.int64) for e in encs]


def prepare(cache_dir: Path, log=print):
    """Train the tokenizer and cache the tokenized splits (idempotent)."""
    from transformers import AutoTokenizer

    tok_dir = cache_dir / "tokenizer"
    splits = split_files()
    if (tok_dir / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    else:
        tokenizer = train_tokenizer(splits["train"], tok_dir)
    stats = {}
    for name, files in splits.items():
        path = cache_dir / f"{name}.u16.npy"
        if not path.exists():
            np.save(path, encode_files(tokenizer, files))
        arr = np.load(path, mmap_mode="r")
        nbytes = sum(p.stat().st_size for _, p in files)
        stats[name] = {"files": len(files), "bytes": nbytes, "tokens": int(arr.shape[0])}
        log(f"[corpus] {name}: {len(files)} files, {nbytes/1e6:.2f} MB, {arr.shape[0]:,} tokens")
    return tokenizer, tok_dir, stats

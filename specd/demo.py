"""The demo pair in models/demo: its directories, the prompt `specd demo`
generates from, and the held-out prompts `specd bench` runs by default."""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO_ROOT / "models/demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFTER = DEMO_DIR / "drafter"
DEMO_EAGLE = DEMO_DIR / "eagle"
DEMO_PROMPT = "def read_config(path):\n    with open(path) as f:\n        return"
# 16 prompts of 96 tokens from held-out files of the demo's corpus, as the demo
# tokenizer's ids and as text: what benchmarks/ run (training/evaluate_pair.py
# make_prompts; `python -m training.bench_prompts` writes this file).
BENCH_PROMPTS = DEMO_DIR / "bench_prompts.jsonl"


def bench_prompts(path: Path = BENCH_PROMPTS) -> list[dict]:
    """The held-out prompts: each {"ids": [...], "text": "..."}."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

"""Writes models/demo/bench_prompts.jsonl: the held-out prompts `specd bench`
runs by default (make_prompts with the demo target's tokenizer), as token ids
and as text, so that the runtime reads them without training/.

    python -m training.bench_prompts [PAIR_DIR]   # default models/demo
"""

import json
import sys
from pathlib import Path

from specd.demo import BENCH_PROMPTS, DEMO_DIR

from .evaluate_pair import make_prompts

N, LENGTH, MIN_ROOM = 16, 96, 128  # specd bench's defaults (docs/bench.md)


def lines(tokenizer) -> list[str]:
    prompts = make_prompts(tokenizer, N, LENGTH, MIN_ROOM)
    return [json.dumps({"ids": p.tolist(), "text": tokenizer.decode(p.tolist())}) for p in prompts]


def main(argv: list[str]) -> None:
    from specd_core.runtime.models import load_tokenizer

    pair = Path(argv[0]) if argv else DEMO_DIR
    out = pair / BENCH_PROMPTS.name
    out.write_text("\n".join(lines(load_tokenizer(str(pair / "target")))) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

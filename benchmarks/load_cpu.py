"""CPU seconds of loading a model for the lean engine in a fresh interpreter:
HF's path (LeanModel(load_model(dir))) against the direct one
(specd_core/runtime/lean_load.py), after `import torch, transformers` as every
replica process has done by then; rounds alternate so drift hits both alike.

    .venv/bin/python benchmarks/load_cpu.py models/demo/target [more dirs] [--rounds 3]

Each measurement is its own interpreter (a replica is one), so the figures
include the imports each path triggers: that is the cost being compared.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# Run in the child: one load, then CPU seconds and whether HF's modeling stack came in.
CHILD = """
import resource, sys
import torch, transformers
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0 = cpu()
if sys.argv[2] == "hf":
    from specd_core.runtime.lean import LeanModel
    from specd_core.runtime.models import load_model
    lm = LeanModel(load_model(sys.argv[1], "cpu"))
else:
    from specd_core.runtime.lean_load import load_lean
    lm = load_lean(sys.argv[1], "cpu")
    assert lm is not None, "the direct path does not cover this checkpoint"
print(cpu() - t0, "transformers.modeling_utils" in sys.modules)
"""


def measure(model_dir: str, path: str) -> tuple[float, bool]:
    """(CPU seconds, modeling_utils imported) of one load in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model_dir, path], capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[-2]), out[-1] == "True"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dirs", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for model_dir in args.model_dirs:
        seen: dict[str, list[float]] = {"hf": [], "direct": []}
        for r in range(args.rounds):
            for path in seen:
                seconds, modeling = measure(model_dir, path)
                seen[path].append(seconds)
                print(f"{model_dir} round {r + 1} {path:6s} {seconds:.3f} s CPU  modeling_utils imported: {modeling}")
        for path, values in seen.items():
            print(f"{model_dir} {path:6s} " + " ".join(f"{v:.3f}" for v in values) + f"  min {min(values):.3f} s")


if __name__ == "__main__":
    main()

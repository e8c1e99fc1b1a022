#!/usr/bin/env bash
# Full rebuild of the demo pair: tokenizer -> target -> distilled drafter ->
# held-out evaluation -> specd bench's default prompts -> model card. Run from the repository root:
#   nohup bash training/run_all.sh > training/logs/run_all.out 2>&1 &
# Budgets (minutes) can be overridden: TARGET_MIN=38 DRAFTER_MIN=24 bash training/run_all.sh
set -euo pipefail
OUT=${OUT:-models/demo}
mkdir -p training/logs
start=$(date +%s)
python -m training.build_demo_pair --out "$OUT" \
    --target-minutes "${TARGET_MIN:-38}" --drafter-minutes "${DRAFTER_MIN:-24}"
python -m training.evaluate_pair "$OUT" | tee training/logs/evaluate_pair.log
python -m training.bench_prompts "$OUT"
python -m training.model_card "$OUT" --wall-minutes "$(( ($(date +%s) - start) / 60 ))"
du -sh "$OUT"

#!/usr/bin/env bash
# Run the whole test suite (expects ./scripts/setup.sh to have run). Every test
# starts and stops its own services and Ray cluster; nothing needs to be running.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false RAY_DISABLE_USAGE_STATS=1 PYTHONUNBUFFERED=1
python -m pytest -q -ra --durations=10 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  # pytest's "no tests were collected": neither a pass nor a test failure - the
  # suite is misconfigured. Say so and exit non-zero with pytest's own code.
  echo "test.sh: ERROR: pytest collected no tests (exit code 5); the test selection is wrong" >&2
fi
exit "$rc"

#!/usr/bin/env bash
# Run the checks and the test suite (expects ./scripts/setup.sh to have run).
#
#   ./scripts/test.sh                 lint and every test (what CI runs)
#   ./scripts/test.sh --fast          lint and the fast tier: the unit tests but their
#                                     large-sample statistical ones (-m "unit and not statistical")
#   ./scripts/test.sh -m services     lint and any pytest selection / arguments
#   ./scripts/test.sh --no-lint ...   skip the lint step (e.g. while iterating on a test)
#
# The tiers (unit, services, cluster; statistical across them) are described in
# tests/README.md. The tests start and stop the services and Ray clusters they
# need (shared between tests where the same one serves); nothing needs to be
# running.
#
# Lint: `ruff check` and `ruff format --check` on the runtime packages and the
# benchmarks, and `mypy` (its files and settings come from pyproject.toml's
# [tool.mypy]), run beside the tests; their output is printed after the tests'.
# One run reports both; the exit status is non-zero if either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false RAY_DISABLE_USAGE_STATS=1 PYTHONUNBUFFERED=1

# The runtime packages (the shared core, the three services, the CLI) and the benchmarks.
LINTED=(specd_core drafter_svc verifier_svc orchestrator specd benchmarks)
lint=1
args=()
for a in "$@"; do
  case "$a" in
    --fast) args+=(-m "unit and not statistical") ;;
    --no-lint) lint=0 ;;
    *) args+=("$a") ;;
  esac
done

failed=()
# Lint runs beside the tests, not before them: mypy alone holds one core for
# about 20 s, while the tests start up. Its output is printed once the tests
# end; each check's failure lands in `failed` like a test failure.
lint_dir=$(mktemp -d)
trap 'rm -rf "$lint_dir"' EXIT
lint_checks() {
  ruff check "${LINTED[@]}" > "$lint_dir/ruff-check" 2>&1 || echo "ruff check" >> "$lint_dir/failed"
  ruff format --check "${LINTED[@]}" > "$lint_dir/ruff-format" 2>&1 || echo "ruff format --check" >> "$lint_dir/failed"
  mypy > "$lint_dir/mypy" 2>&1 || echo "mypy" >> "$lint_dir/failed"
}
if [ "$lint" -eq 1 ]; then
  echo "test.sh: lint (ruff check, ruff format --check, mypy) runs beside the tests; its output follows them"
  lint_checks &
  lint_pid=$!
fi
report_lint() {
  [ "$lint" -eq 1 ] || return 0
  wait "$lint_pid"
  echo "test.sh: lint: ruff check ${LINTED[*]}"; cat "$lint_dir/ruff-check"
  echo "test.sh: lint: ruff format --check ${LINTED[*]}"; cat "$lint_dir/ruff-format"
  echo "test.sh: lint: mypy"; cat "$lint_dir/mypy"
  if [ -f "$lint_dir/failed" ]; then
    while IFS= read -r check; do failed+=("$check"); done < "$lint_dir/failed"
  fi
}

# One pytest run; records its exit code in `rc` (the first failing run's) and
# what failed in `failed`.
rc=0
run_pytest() {
  local label=${1:+ $1}; shift
  python -m pytest -q -ra --durations=20 "$@"
  local code=$?
  if [ "$code" -eq 5 ]; then
    # pytest's "no tests were collected" (also: a -m selection that matched
    # nothing): neither a pass nor a test failure - the selection is wrong.
    echo "test.sh: ERROR: pytest collected no tests$label (exit code 5); the test selection is wrong" >&2
    failed+=("pytest$label: no tests collected")
  elif [ "$code" -ne 0 ]; then
    failed+=("pytest$label (exit code $code)")
  fi
  [ "$code" -ne 0 ] && [ "$rc" -eq 0 ] && rc=$code
  return 0
}

# Two workers (pytest-xdist): most tests wait on processes and sockets, so one
# worker leaves a core idle; loadgroup keeps a module's tests on one worker,
# and the groups are taken in tests/conftest.py's order, the longest first
# (--no-loadscope-reorder: xdist's own order is by number of tests, which
# left the longest modules for the end). SPECD_TEST_WORKERS=0 runs
# everything in this process.
#
# The whole suite is one run: the cluster tier is one of the groups (its
# tests one after another on one worker, one Ray cluster at a time), taken
# once the longest services modules have been handed out, so it runs beside
# the other worker's shorter modules instead of after everything with a core
# idle. Its timeouts are not at risk there: they are minutes where the steps
# take seconds, and the whole tier passed at load averages of 15-25 on these
# 2 cores (tests/README.md).
xdist=(-n "${SPECD_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder)
run_pytest "" "${xdist[@]}" "${args[@]}"
report_lint

if [ "${#failed[@]}" -gt 0 ]; then
  echo "test.sh: FAILED: $(IFS=';'; echo "${failed[*]}" | sed 's/;/; /g')" >&2
  # pytest's own code when pytest failed (the first failing run's), else 1 (lint only).
  [ "$rc" -ne 0 ] && exit "$rc"
  exit 1
fi
echo "test.sh: all passed"

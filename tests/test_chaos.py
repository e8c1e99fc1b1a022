"""The chaos run's short variant (benchmarks/chaos.py; the long one is
published in benchmarks/README.md): on a Ray deployment of its own with 2
orchestrators behind one address, 2 drafters and 2 verifiers, 16 greedy
streams run through the resuming client while a drafter, a verifier or an
orchestrator gets SIGKILL or SIGSTOP every few seconds (never a whole tier at
once). Every stream equals target-only greedy decoding (no token lost or
repeated), no request fails, every replica ends holding 0 sessions and the
pools are back to full strength."""
import json

import pytest

from benchmarks import chaos

pytestmark = pytest.mark.cluster


def test_chaos_short(tmp_path):
    out = tmp_path / "chaos.json"
    code = chaos.main(["--seconds", "45", "--every", "2", "5", "--pause", "1", "4", "--max-new", "64",
                       "--out", str(out)])
    doc = json.loads(out.read_text())
    summary = {k: doc[k] for k in ("faults_by_kind", "requests", "tokens", "resumes", "counters", "checks",
                                   "errors", "mismatches", "end_state")}
    assert code == 0 and doc["passed"], json.dumps(summary, indent=1)[:6000]
    assert doc["faults"] >= 6, doc["faults_by_kind"]
    kinds = {kind for kind, by_tier in doc["faults_by_kind"].items() if by_tier}
    assert kinds == {"kill", "stop"}, doc["faults_by_kind"]
    assert doc["requests"] >= 16 and doc["tokens"] > 0

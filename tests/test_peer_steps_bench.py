"""benchmarks/peer_steps.py's own parts: the ratios it prints come from the
steps of the same rounds, and without vLLM it says so and writes nothing.
(The measurement itself needs vLLM's CPU build, which the suite does not
install: `python -m benchmarks.peer_steps` runs it.)"""

import pytest

from benchmarks import peer_steps

pytestmark = pytest.mark.unit


def test_growth_and_the_ratio_between_systems_pair_steps_by_round():
    ms = {
        "vLLM": {
            "1 decode": [10, 20, 10],
            "64 decode": [30, 60, 30],
            "1 5 rows": [10, 10, 10],
            "64 5 rows": [50, 50, 50],
        },
        "specd": {
            "1 decode": [20, 20, 20],
            "64 decode": [40, 80, 40],
            "1 5 rows": [20, 40, 20],
            "64 5 rows": [100, 200, 100],
        },
    }
    got = peer_steps.summaries(ms, [1, 64])
    # Round by round 64 over 1: vLLM 3, 3, 3; specd 2, 4, 2 (decode) and 5, 5, 5 (5 rows).
    assert got["last_over_first"]["vLLM"]["decode"]["rounds"] == [3.0, 3.0, 3.0]
    assert got["last_over_first"]["specd"]["decode"]["rounds"] == [2.0, 4.0, 2.0]
    assert got["last_over_first"]["specd"]["5 rows"]["geomean"] == pytest.approx(5.0)
    assert got["specd_over_vllm"]["64 5 rows"]["rounds"] == [2.0, 4.0, 2.0]
    assert got["specd_over_vllm"]["1 decode"]["rounds"] == [2.0, 1.0, 2.0]


def test_without_vllm_it_says_why_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "steps.json"
    code = peer_steps.main(["--no-install", "--vllm-venv", str(tmp_path / "no-venv"), "--out", str(out)])
    assert code == 0
    assert "peer_steps: skipped: vLLM does not run from" in capsys.readouterr().out
    assert not out.exists()

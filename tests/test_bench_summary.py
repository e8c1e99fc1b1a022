"""specd/bench.py's pure parts: prompts and settings input, percentiles,
latencies, stats totals, τ and acceptance per position, speedup and its
interval, and `specd bench` saying what is missing when matplotlib is."""

import json
import math

import pytest

from specd import bench, cli
from specd.bench import RequestRecord

pytestmark = pytest.mark.unit


def test_load_prompts_text_and_chat(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert bench.load_prompts(p) == [{"prompt": "a"}, {"messages": [{"role": "user", "content": "hi"}]}]
    req = bench.build_request(bench.load_prompts(p)[1], {"num_speculative_tokens": 3}, 8)
    assert req.messages[0].content == "hi" and req.num_speculative_tokens == 3 and req.max_new_tokens == 8
    with pytest.raises(bench.BenchError, match="no prompts"):
        (tmp_path / "e.jsonl").write_text("\n")
        bench.load_prompts(tmp_path / "e.jsonl")
    with pytest.raises(bench.BenchError, match="missing.jsonl"):
        bench.load_prompts(tmp_path / "missing.jsonl")


def test_settings_from_flags_and_file(tmp_path):
    s = bench.settings_from_flags(["draft_model", "ngram"], [2, 4], [2, 1])
    assert [x.label for x in s] == ["off", "draft_model K=2", "draft_model K=4", "draft_model tree 2x1",
                                    "ngram K=2", "ngram K=4", "ngram tree 2x1"]
    assert s[0].is_off and not s[1].is_off
    req = bench.build_request({"prompt": "x"}, s[3].fields, 4)
    assert list(req.tree.branching) == [2, 1] and req.speculative_method == "draft_model"

    f = tmp_path / "s.yaml"
    f.write_text("- {label: k3, num_speculative_tokens: 3}\n- {speculative_method: ngram}\n")
    got = bench.settings_from_file(f)
    assert [x.label for x in got] == ["off", "k3", "speculative_method=ngram"]  # off put first
    j = tmp_path / "s.json"
    j.write_text(json.dumps([{"speculative_method": "off"}, {"num_speculative_tokens": 2}]))
    assert [x.is_off for x in bench.settings_from_file(j)] == [True, False]  # an off of its own: none added
    j.write_text("[1, 2]")
    with pytest.raises(bench.BenchError, match="list of GenerateRequest field objects"):
        bench.settings_from_file(j)
    with pytest.raises(bench.BenchError, match="no_such_field"):
        bench.build_request({"prompt": "x"}, {"no_such_field": 1}, 4)


def test_percentile_and_latencies():
    assert bench.percentile([3, 1, 2], 50) == 2
    assert bench.percentile([0, 10], 90) == pytest.approx(9.0)
    assert bench.percentile([5], 99) == 5
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    a = RequestRecord(0, start=1.0, arrivals=[(1.5, 1), (1.7, 2), (2.6, 1)])
    b = RequestRecord(1, start=0.5, arrivals=[(0.8, 1), (1.2, 1)])  # started before the window
    ttft, itl = bench.latencies([a, b], (1.0, 2.5))
    assert ttft == [pytest.approx(0.5)]
    # a's 2-token message after 0.2 s: two gaps of 0.1; the 2.6 arrival is past the window; b's 1.2: 0.4
    assert sorted(itl) == pytest.approx([0.1, 0.1, 0.4])


def test_stats_totals_tau_and_acceptance():
    stats = [
        {"cycles": 4, "drafted_tokens": 16, "accepted_tokens": 11, "drafts": 4, "mean_accepted_length": 3.75,
         "completion_tokens": 16, "prompt_tokens": 5, "accepted_per_position": [4, 3, 2, 2]},
        {"cycles": 3, "drafted_tokens": 8, "accepted_tokens": 2, "drafts": 2, "mean_accepted_length": 5 / 3,
         "completion_tokens": 6, "prompt_tokens": 5, "accepted_per_position": [2, 0]},
        {"cycles": 0, "completion_tokens": 1},  # finished at the prefill
    ]
    tot = bench.stats_totals(stats)
    assert tot["cycles"] == 7 and tot["drafted_tokens"] == 24 and tot["drafts"] == 6
    assert tot["committed_in_cycles"] == 15 + 5 and tot["completion_tokens"] == 23
    assert tot["accepted_per_position"] == [6, 3, 2, 2]
    acc = bench.acceptance(tot)
    assert acc["mean_accepted_length"] == pytest.approx(20 / 7, abs=1e-4)  # total committed / total cycles
    assert acc["acceptance_per_position"] == pytest.approx([1.0, 0.5, 1 / 3, 1 / 3], abs=1e-4)
    assert bench.acceptance(bench.stats_totals([])) == {"mean_accepted_length": None, "acceptance_per_position": []}


def _rec(i, start, times, stats):
    return RequestRecord(i, start, [(t, 2) for t in times], "length", stats)


def test_level_summary_and_speedup():
    s = {"cycles": 2, "drafted_tokens": 4, "accepted_tokens": 2, "drafts": 2, "mean_accepted_length": 2.0,
         "completion_tokens": 4, "accepted_per_position": [2, 0]}
    rounds = [([_rec(0, 0.0, [0.5, 1.0], s)], (0.0, 1.0 + 1e-9)), ([_rec(1, 5.0, [5.5, 7.0], s)], (5.0, 7.0 + 1e-9))]
    out = bench.level_summary(rounds)
    assert out["tokens"] == 8 and out["seconds"] == pytest.approx(3.0) and out["tokens_per_s"] == pytest.approx(8 / 3, abs=1e-3)
    assert out["rounds_tokens_per_s"] == pytest.approx([4.0, 2.0])
    assert out["ttft_ms_p50"] == pytest.approx(500.0) and out["itl_ms_p99"] <= 750.0
    assert out["mean_accepted_length"] == 2.0 and out["acceptance_per_position"] == [1.0, 0.0]
    assert out["totals"]["cycles"] == 4 and out["requests"] == 2

    on = {"tokens_per_s": 30.0, "rounds_tokens_per_s": [31.0, 29.0, 30.0]}
    off = {"tokens_per_s": 20.0, "rounds_tokens_per_s": [20.0, 20.0, 19.0]}
    sp = bench.speedup(on, off)
    assert sp["speedup"] == 1.5
    lo, hi = sp["speedup_interval"]
    geo = math.exp(sum(math.log(a / b) for a, b in zip(on["rounds_tokens_per_s"], off["rounds_tokens_per_s"])) / 3)
    assert lo < geo < hi and hi / lo < 1.2
    assert bench.speedup(on | {"rounds_tokens_per_s": [1, 2]}, off)["speedup_interval"] is None  # < 3 rounds

    rows = bench.build_rows({("off", 1): off, ("k4", 1): on}, "off")
    assert [(r["setting"], r["speedup"]) for r in rows] == [("off", None), ("k4", 1.5)]


def test_bench_says_when_matplotlib_is_missing(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["bench", "--address", "127.0.0.1:1", "--prompts", "x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "specd[bench]" in err

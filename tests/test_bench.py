"""`specd bench` as the real command: on the demo pair with its own local
stack, the JSON report's figures agree with the services' own GenerationStats
and the PNG is a readable image; the progress bar shows on a terminal (a
pseudo-terminal) and not when stderr is a pipe; bad input is refused by name."""

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models/demo"
PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n        return",
    "import os\n\n\ndef main():\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "for i in range(10):\n",
]
MAX_NEW = 16
STAT_KEYS = ("cycles", "drafted_tokens", "accepted_tokens", "drafts", "completion_tokens")

pytestmark = pytest.mark.services


def _prompts_file(tmp_path, prompts=PROMPTS) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def _bench(*args, cwd, stderr=subprocess.PIPE, timeout=240):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "specd", "bench", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=stderr, text=True, timeout=timeout)


@pytest.mark.skipif(not (DEMO / "target/config.json").exists(), reason="demo pair not built")
def test_bench_demo_pair_report_agrees_with_service_stats(tmp_path):
    prompts = _prompts_file(tmp_path)
    r = _bench("--prompts", str(prompts), "--concurrency", "1", "2", "--rounds", "2", "--max-new-tokens", str(MAX_NEW),
               "--out", "r.json", "--plot", "r.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "| draft_model K=4 | 2 |" in r.stdout
    assert "%|" not in r.stderr  # stderr is a pipe: no progress bar

    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(tmp_path / "r.png") as im:
        assert im.format == "PNG" and im.size[0] > 600 and im.size[1] > 200

    report = json.loads((tmp_path / "r.json").read_text())
    assert [s["label"] for s in report["settings"]] == ["off", "draft_model K=4"]
    # Alternating rounds: round 2 runs the settings in the reverse order.
    for n in (1, 2):
        order = [[s["setting"] for s in report["schedule"] if s["concurrency"] == n and s["round"] == r] for r in (0, 1)]
        assert order == [["off", "draft_model K=4"], ["draft_model K=4", "off"]]
    rows = {(row["setting"], row["concurrency"]): row for row in report["rows"]}
    assert set(rows) == {(s, n) for s in ("off", "draft_model K=4") for n in (1, 2)}
    for (setting, n), row in rows.items():
        recs = row["request_records"]
        # max(4 prompts, 2 x level) requests per round, each prompt in every round
        assert len(recs) == row["requests"] == 2 * max(len(PROMPTS), 2 * n)
        assert sorted((x["round"], x["prompt"]) for x in recs) == sorted(
            (rnd, i % len(PROMPTS)) for rnd in (0, 1) for i in range(max(len(PROMPTS), 2 * n)))
        for x in recs:
            # the tokens the client counted are what the service says it made:
            # max_new_tokens, or fewer with a stop the finish reason names
            assert x["tokens"] == x["stats"]["completion_tokens"]
            assert x["tokens"] == MAX_NEW if x["finish_reason"] == "length" else (
                x["finish_reason"] == "stop" and x["tokens"] < MAX_NEW), x
        # the report's totals are the sums of the requests' GenerationStats
        tot = row["totals"]
        for k in STAT_KEYS:
            assert tot[k] == sum(int(x["stats"][k]) for x in recs), (setting, n, k)
        width = len(tot["accepted_per_position"])
        assert tot["accepted_per_position"] == [
            sum(int(x["stats"]["accepted_per_position"][i]) for x in recs) for i in range(width)]
        assert row["tokens"] == sum(x["tokens"] for x in recs) == tot["completion_tokens"]
        # every token after the prefill's first is committed in a verify cycle
        assert tot["committed_in_cycles"] == tot["completion_tokens"] - len(recs)
        assert row["mean_accepted_length"] == pytest.approx(tot["committed_in_cycles"] / tot["cycles"], abs=1e-4)
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=1e-3)
        assert len(row["rounds_tokens_per_s"]) == 2
        for q in ("ttft_ms", "itl_ms"):
            assert 0 < row[f"{q}_p50"] <= row[f"{q}_p90"] <= row[f"{q}_p99"]
        if setting == "off":
            assert tot["drafted_tokens"] == 0 and row["mean_accepted_length"] == 1.0 and row["speedup"] is None
        else:
            off = rows[("off", n)]
            assert row["speedup"] == pytest.approx(row["tokens_per_s"] / off["tokens_per_s"], rel=1e-3)
            assert row["speedup_interval"] is None  # fewer than 3 rounds: no interval
            assert tot["drafted_tokens"] > 0 and 1.0 <= row["mean_accepted_length"] <= 5.0
            acc = row["acceptance_per_position"]
            assert len(acc) == 4 and acc == pytest.approx([a / tot["drafts"] for a in tot["accepted_per_position"]],
                                                          abs=1e-4)
            # a chain: reaching position i + 1 means reaching i
            assert all(a >= b for a, b in zip(acc, acc[1:])) and 0 < acc[0] <= 1


def _run_on_pty(args, cwd, timeout=120) -> tuple[int, str]:
    """Run `specd bench ARGS` with stderr on a pseudo-terminal; (rc, what it wrote there)."""
    master, slave = pty.openpty()
    # A terminal 100 columns wide (a bare pty reports 0, where tqdm draws nothing).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "specd", "bench", *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            if not ready:
                raise TimeoutError(out.decode(errors="replace"))
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        rc = proc.wait(30)
    return rc, out.decode(errors="replace")


def test_progress_bar_on_a_terminal_only(tmp_path, stacks):
    address = stacks["llama"].orchestrator.address
    prompts = _prompts_file(tmp_path, PROMPTS[:2])
    args = ["--address", address, "--prompts", str(prompts), "--concurrency", "1", "--rounds", "1",
            "--max-new-tokens", "4", "--plot", "", "--out", "r.json"]
    rc, err = _run_on_pty(args, tmp_path)
    assert rc == 0, err
    # tqdm's bar: 2 settings x 2 requests, drawn with block characters up to 100%
    assert "100%|" in err and "█" in err and "4/4" in err, err
    r = _bench(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "%|" not in r.stderr and "█" not in r.stderr and "wrote r.json" in r.stderr


@pytest.mark.parametrize("line,needle", [
    ("not json", "line 2: not JSON"),
    ('{"text": "x"}', 'line 2: expected {"prompt": "..."} or {"messages": [...]}'),
])
def test_bad_prompts_file_is_refused_by_line(tmp_path, line, needle):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    r = _bench("--address", "127.0.0.1:1", "--prompts", str(path), "--plot", "", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert not (tmp_path / "bench.json").exists()

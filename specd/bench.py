"""`specd bench`: what speculation buys on a user's own pair and prompts.

Closed-loop streams at each concurrency level (n workers, each starting its
next request when its last one ends), every setting (speculation off and on)
run in alternating rounds (the settings' order reversed every other round, so
a drift of the machine's speed weighs on every setting alike), then pure
functions turn the per-request records into the report: tokens/s, speedup vs
off with an interval from the rounds, mean accepted length, acceptance per
draft position, TTFT and ITL percentiles, and the services' own stats totals.

`run_streams` is also the loop of benchmarks/load.py (its time-window mode).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specd.demo import DEMO_TARGET, bench_prompts

PERCENTILES = (50, 90, 99)
# GenerationStats fields summed over a setting's requests (the report's totals).
STAT_TOTALS = ("cycles", "drafted_tokens", "accepted_tokens", "drafts", "prompt_tokens", "completion_tokens")


class BenchError(Exception):
    """Bad bench input (prompts or settings file, flags): the message names it."""


@dataclass
class Setting:
    """One way to run the requests: a label and GenerateRequest fields (a
    dict as protobuf's JSON mapping reads it, e.g. {"tree": {"branching": [2, 1]}})."""

    label: str
    fields: dict

    @property
    def is_off(self) -> bool:
        return self.fields.get("num_speculative_tokens", self.fields.get("numSpeculativeTokens")) == 0 or (
            self.fields.get("speculative_method", self.fields.get("speculativeMethod")) == "off"
        )


OFF = Setting("off", {"num_speculative_tokens": 0})


@dataclass
class RequestRecord:
    """One Generate stream as the client saw it. stats: the final message's
    GenerationStats as a dict (None when the stream was cancelled)."""

    index: int  # which request of the run (prompts are taken round-robin)
    start: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per message with tokens
    finish_reason: str = ""
    stats: dict | None = None
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(k for _, k in self.arrivals)


# ---------------------------------------------------------------- inputs


def settings_from_flags(methods: Sequence[str], ks: Sequence[int], tree: Sequence[int] | None) -> list[Setting]:
    """off, then per method one chain setting per K (and a tree setting with
    --tree: the branching factors per depth)."""
    out = [OFF]
    for method in methods:
        if method == "off":
            continue
        for k in ks:
            out.append(Setting(f"{method} K={k}", {"speculative_method": method, "num_speculative_tokens": k}))
        if tree:
            out.append(
                Setting(
                    f"{method} tree {'x'.join(map(str, tree))}",
                    {"speculative_method": method, "tree": {"branching": list(tree)}},
                )
            )
    return out


def settings_from_file(path: Path) -> list[Setting]:
    """A JSON or YAML list of GenerateRequest field dicts (an optional `label`
    key names one); `off` is put first unless one of them turns speculation off."""
    text = _read(path)
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - json and yaml raise different classes
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        raise BenchError(f"--settings {path}: not valid {kind}: {exc}") from None
    if not isinstance(data, list) or not data or not all(isinstance(d, dict) for d in data):
        raise BenchError(f"--settings {path}: expected a non-empty list of GenerateRequest field objects")
    out = []
    for i, d in enumerate(data):
        d = dict(d)
        label = str(d.pop("label", "") or _label(d) or f"setting {i}")
        out.append(Setting(label, d))
    if not any(s.is_off for s in out):
        out.insert(0, OFF)
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise BenchError(f"--settings {path}: two settings share a label ({labels}); give each a `label`")
    return out


def _label(fields: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def load_prompts(path: Path) -> list[dict]:
    """JSONL: each line {"prompt": "..."} or {"messages": [{"role", "content"}, ...]};
    blank lines skipped. Returns the request input fields per prompt."""
    out = []
    for n, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"--prompts {path} line {n}: not JSON: {exc}") from None
        if isinstance(d, dict) and isinstance(d.get("prompt"), str):
            out.append({"prompt": d["prompt"]})
        elif isinstance(d, dict) and isinstance(d.get("messages"), list) and d["messages"]:
            out.append({"messages": d["messages"]})
        else:
            raise BenchError(f'--prompts {path} line {n}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
    if not out:
        raise BenchError(f"--prompts {path}: no prompts")
    return out


def demo_prompts(target: str) -> list[dict]:
    """The demo's held-out prompts (what benchmarks/ run; specd/demo.py): as
    token ids when the target reads text as the demo target does (the same
    vocabulary), else as text."""
    from specd_core.runtime.models import load_tokenizer

    prompts = bench_prompts()
    if load_tokenizer(target).get_vocab() == load_tokenizer(str(DEMO_TARGET)).get_vocab():
        return [{"prompt_token_ids": {"ids": p["ids"]}} for p in prompts]
    return [{"prompt": p["text"]} for p in prompts]


def _read(path: Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise BenchError(f"{path}: {exc.strerror or exc}") from None


def build_request(prompt: dict, setting: dict, max_new_tokens: int):
    """The GenerateRequest for one prompt under one setting; an unknown field
    or a bad value is a BenchError naming it."""
    from google.protobuf import json_format

    from specd_core.api.v1 import specdec_pb2 as pb

    try:
        return json_format.ParseDict({**prompt, **setting, "max_new_tokens": max_new_tokens}, pb.GenerateRequest())
    except json_format.ParseError as exc:
        raise BenchError(f"bad GenerateRequest fields {setting}: {exc}") from None


# ---------------------------------------------------------------- the loop


def run_streams(
    call: Callable,
    requests: Sequence,
    n: int,
    count: int | None = None,
    until: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """n streams in flight: n workers each run requests back to back
    (requests[i % len(requests)] for the i-th). With `count`, the run ends
    after that many requests; with `until` (a perf_counter time), the streams
    still running then are cancelled (their records have no stats).

    call(request) starts one Generate and returns the streaming call (it is
    iterated and may be cancelled). A failed stream (other than cancelled at
    the end) raises RuntimeError after all workers have stopped."""
    streams = _Streams(call, requests, count, on_done)
    threads = [threading.Thread(target=streams.worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    if until is not None:
        time.sleep(max(0.0, until - time.perf_counter()))
        streams.cancel_all()
    for t in threads:
        t.join()
    errors = [r.error for r in streams.records if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed, e.g. {errors[0]}")
    return sorted(streams.records, key=lambda r: r.index)


class _Streams:
    """What run_streams' workers share: the next request's index, the records,
    the calls in flight (to cancel) and the stop flag (a failure, or the end)."""

    def __init__(self, call: Callable, requests: Sequence, count: int | None, on_done) -> None:
        self.call, self.requests, self.on_done = call, requests, on_done
        self.records: list[RequestRecord] = []
        self.lock = threading.Lock()
        self.calls: set = set()
        self.stop = threading.Event()
        self.counter = iter(range(count if count is not None else 10**12))

    def worker(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                i = next(self.counter, None)
            if i is None:
                return
            self.one(i)

    def cancel_all(self) -> None:
        self.stop.set()
        with self.lock:
            for c in list(self.calls):
                c.cancel()

    def one(self, i: int) -> None:
        import grpc

        rec = RequestRecord(i, time.perf_counter())
        c = self.call(self.requests[i % len(self.requests)])
        with self.lock:
            self.calls.add(c)
            self.records.append(rec)
        if self.stop.is_set():
            c.cancel()
        try:
            for r in c:
                if r.token_ids:
                    rec.arrivals.append((time.perf_counter(), len(r.token_ids)))
                if r.finish_reason:
                    rec.finish_reason = r.finish_reason
                    rec.stats = _stats_dict(r.stats)
        except grpc.RpcError as e:
            if not (self.stop.is_set() and e.code() == grpc.StatusCode.CANCELLED):
                rec.error = f"{e.code().name}: {e.details()}"
                self.stop.set()
        finally:
            with self.lock:
                self.calls.discard(c)
        if self.on_done and rec.stats is not None:
            self.on_done(rec)


def _stats_dict(stats) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


# ---------------------------------------------------------------- summaries (pure)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics."""
    s = sorted(values)
    if not s:
        raise ValueError("percentile of no values")
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latencies(records: Iterable[RequestRecord], window: tuple[float, float]) -> tuple[list[float], list[float]]:
    """(TTFT of the streams that started in the window, inter-token gaps in
    it), seconds. A message of k tokens counts as k gaps of its wait / k
    (tokens that arrive together each waited that long on average)."""
    ttft, itl = [], []
    for r in records:
        if r.arrivals and window[0] <= r.start < window[1]:
            ttft.append(r.arrivals[0][0] - r.start)
        for (prev, _), (now, k) in zip(r.arrivals, r.arrivals[1:]):
            if window[0] <= now < window[1]:
                itl.extend([(now - prev) / k] * k)
    return ttft, itl


def stats_totals(stats: Iterable[dict]) -> dict:
    """Sums of the requests' GenerationStats: STAT_TOTALS, the tokens committed
    in verify cycles (mean_accepted_length x cycles, per request: the stats
    carry the mean, not the count) and accepted_per_position element-wise."""
    tot: dict = dict.fromkeys(STAT_TOTALS, 0)
    tot["committed_in_cycles"] = 0
    per_pos: list[int] = []
    for s in stats:
        for k in STAT_TOTALS:
            tot[k] += int(s.get(k, 0))
        tot["committed_in_cycles"] += round(float(s.get("mean_accepted_length", 0.0)) * int(s.get("cycles", 0)))
        app = [int(x) for x in s.get("accepted_per_position", [])]
        per_pos += [0] * (len(app) - len(per_pos))
        for i, x in enumerate(app):
            per_pos[i] += x
    tot["accepted_per_position"] = per_pos
    return tot


def acceptance(totals: dict) -> dict:
    """τ (tokens committed per verify cycle, bonus included: total committed /
    total cycles) and, per draft position, the share of drafting cycles whose
    accepted path reached it (None where nothing was drafted)."""
    tau = totals["committed_in_cycles"] / totals["cycles"] if totals["cycles"] else None
    per_pos = [x / totals["drafts"] for x in totals["accepted_per_position"]] if totals["drafts"] else []
    return {
        "mean_accepted_length": None if tau is None else round(tau, 4),
        "acceptance_per_position": [round(p, 4) for p in per_pos],
    }


def round_summary(records: Sequence[RequestRecord], window: tuple[float, float]) -> dict:
    """One setting x level x round: tokens that arrived in the window / its length."""
    tokens = sum(k for r in records for when, k in r.arrivals if window[0] <= when < window[1])
    seconds = window[1] - window[0]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


def level_summary(rounds: Sequence[tuple[Sequence[RequestRecord], tuple[float, float]]]) -> dict:
    """A setting at one level over its rounds: tokens/s over the summed time
    (and per round, for the intervals), latency percentiles over all rounds'
    samples, the services' stats totals and what they give (τ, acceptance)."""
    parts = [round_summary(recs, w) for recs, w in rounds]
    ttft, itl = [], []
    for recs, w in rounds:
        a, b = latencies(recs, w)
        ttft += a
        itl += b
    finished = [r for recs, _ in rounds for r in recs if r.stats is not None]
    totals = stats_totals(r.stats for r in finished if r.stats is not None)
    tokens, seconds = sum(p["tokens"] for p in parts), sum(p["seconds"] for p in parts)
    out = {
        "requests": len(finished),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else 0.0,
        "rounds_tokens_per_s": [round(p["tokens_per_s"], 3) for p in parts],
    }
    for name, vals in (("ttft_ms", ttft), ("itl_ms", itl)):
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = round(1e3 * percentile(vals, q), 3) if vals else None
    out.update(acceptance(totals))
    out["totals"] = totals
    return out


def log_ratio_interval(a: Sequence[float], b: Sequence[float], z: float = 2.0) -> list[float] | None:
    """A rough 95 % interval for a over b from paired rounds (a[i] ran next to
    b[i]): the geometric mean of the ratios times / over exp(z * their log
    standard error). None with fewer than 3 rounds."""
    ratios = [x / y for x, y in zip(a, b) if x > 0 and y > 0]
    if len(ratios) < 3:
        return None
    logs = [math.log(r) for r in ratios]
    mean, se = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    return [round(math.exp(mean - z * se), 3), round(math.exp(mean + z * se), 3)]


def speedup(on: dict, off: dict) -> dict:
    """on's tokens/s over off's (same level), with an interval from the rounds."""
    ratio = on["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else None
    return {
        "speedup": None if ratio is None else round(ratio, 4),
        "speedup_interval": log_ratio_interval(on["rounds_tokens_per_s"], off["rounds_tokens_per_s"]),
    }


def build_rows(levels: dict[tuple[str, int], dict], off_label: str | None) -> list[dict]:
    """Report rows (setting, concurrency, figures), each with its speedup vs
    the off setting at the same level (None for off itself or without one)."""
    rows = []
    for (label, n), summary in levels.items():
        row = {"setting": label, "concurrency": n, **summary}
        off = levels.get((off_label, n)) if off_label else None
        if off is not None and label != off_label:
            row.update(speedup(summary, off))
        else:
            row.update(speedup=None, speedup_interval=None)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the run


@dataclass
class BenchConfig:
    settings: list[Setting]
    prompts: list[dict]
    concurrency: list[int]
    rounds: int = 3
    max_new_tokens: int = 128
    requests: int | None = None  # per setting, level and round; default max(prompts, 2 x level)


def requests_per_round(cfg: BenchConfig, n: int) -> int:
    return cfg.requests or max(len(cfg.prompts), 2 * n)


def run_bench(cfg: BenchConfig, call: Callable, progress: bool) -> dict:
    """Every level, its settings in alternating rounds; the report dict.
    call(request) starts one Generate stream (the caller's channel and auth)."""
    from tqdm import tqdm

    reqs = {s.label: [build_request(p, s.fields, cfg.max_new_tokens) for p in cfg.prompts] for s in cfg.settings}
    total = sum(requests_per_round(cfg, n) for n in cfg.concurrency) * cfg.rounds * len(cfg.settings)
    per_request: dict[tuple[str, int], list[dict]] = {}
    measured: dict[tuple[str, int], list] = {}
    schedule: list[dict] = []  # the order the runs went in (rounds alternate it)
    # A warm-up stream per setting: first-call costs (allocation, compilation
    # of a path) are not what is measured.
    for s in cfg.settings:
        run_streams(call, reqs[s.label][:1], 1, count=1)
    with tqdm(total=total, unit="req", disable=not progress, dynamic_ncols=True) as bar:
        for n in cfg.concurrency:
            for r in range(cfg.rounds):
                order = cfg.settings if r % 2 == 0 else cfg.settings[::-1]
                for s in order:
                    bar.set_description(f"x{n} round {r + 1}/{cfg.rounds} {s.label}")
                    schedule.append({"concurrency": n, "round": r, "setting": s.label})
                    t0 = time.perf_counter()
                    recs = run_streams(
                        call, reqs[s.label], n, count=requests_per_round(cfg, n), on_done=lambda _rec: bar.update(1)
                    )
                    t1 = max((rec.arrivals[-1][0] for rec in recs if rec.arrivals), default=time.perf_counter())
                    measured.setdefault((s.label, n), []).append((recs, (t0, t1 + 1e-9)))
                    per_request.setdefault((s.label, n), []).extend(
                        {
                            "round": r,
                            "prompt": rec.index % len(cfg.prompts),
                            "tokens": rec.tokens,
                            "finish_reason": rec.finish_reason,
                            "stats": rec.stats,
                        }
                        for rec in recs
                    )
    levels = {key: level_summary(rounds) for key, rounds in measured.items()}
    off = next((s.label for s in cfg.settings if s.is_off), None)
    rows = build_rows(levels, off)
    for row in rows:
        row["request_records"] = per_request[(row["setting"], row["concurrency"])]
    return {
        "settings": [{"label": s.label, "fields": s.fields} for s in cfg.settings],
        "concurrency": cfg.concurrency,
        "rounds": cfg.rounds,
        "max_new_tokens": cfg.max_new_tokens,
        "prompts": len(cfg.prompts),
        "schedule": schedule,
        "rows": rows,
    }


def table(report: dict) -> str:
    """The report as a Markdown table (what the command prints)."""
    head = (
        "| setting | streams | tok/s | speedup (interval) | τ | accept/pos | TTFT p50/p99 ms | ITL p50/p99 ms |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in report["rows"]:
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}"
        if r["speedup_interval"]:
            sp += f" ({r['speedup_interval'][0]:.2f}-{r['speedup_interval'][1]:.2f})"
        tau = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        pos = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"])
        lines.append(
            f"| {r['setting']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {sp} | {tau} | {pos} "
            f"| {_ms(r['ttft_ms_p50'])}/{_ms(r['ttft_ms_p99'])} | {_ms(r['itl_ms_p50'])}/{_ms(r['itl_ms_p99'])} |"
        )
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def plot(report: dict, path: Path) -> None:
    """Throughput, speedup vs off (with the rounds' interval) and acceptance
    per draft position (all levels pooled) as one PNG. matplotlib: the `bench`
    extra (checked by the command before anything runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == label]
        xs = [r["concurrency"] for r in mine]
        ax.plot(xs, [r["tokens_per_s"] for r in mine], marker="o", label=label)
        sp = [r for r in mine if r["speedup"] is not None]
        if sp:
            ys = [r["speedup"] for r in sp]
            err = [
                [y - (r["speedup_interval"] or [y, y])[0] for y, r in zip(ys, sp)],
                [(r["speedup_interval"] or [y, y])[1] - y for y, r in zip(ys, sp)],
            ]
            ax2.errorbar([r["concurrency"] for r in sp], ys, yerr=err, marker="o", capsize=3, label=label)
        totals = [r["totals"] for r in mine]
        drafts = sum(t["drafts"] for t in totals)
        if drafts:
            width = max(len(t["accepted_per_position"]) for t in totals)
            pos = [
                sum(t["accepted_per_position"][i] for t in totals if i < len(t["accepted_per_position"])) / drafts
                for i in range(width)
            ]
            ax3.plot(range(1, width + 1), pos, marker="o", label=label)
    ax2.axhline(1.0, color="grey", lw=0.8)
    levels = sorted({r["concurrency"] for r in rows})
    for a in (ax, ax2):
        a.set_xticks(levels)
    for a, title, xl, yl in (
        (ax, "throughput", "concurrent streams", "tokens/s (all streams)"),
        (ax2, "speedup vs off", "concurrent streams", "x"),
        (ax3, "acceptance per draft position", "position", "share of drafting cycles"),
    ):
        a.set_title(title)
        a.set_xlabel(xl)
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

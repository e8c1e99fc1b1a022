"""`specd status`'s tables: the replicas, the pools, the orchestrators."""

from __future__ import annotations


def _kv_use(r) -> str:
    """A replica's KV budget use: used/capacity tokens (percent); '-' when unknown."""
    if not r.kv_capacity_tokens:
        return "-"
    return f"{r.kv_used_tokens}/{r.kv_capacity_tokens} ({100 * r.kv_used_tokens / r.kv_capacity_tokens:.0f}%)"


def _prefix_hits(r) -> str:
    """A replica's prefix cache hit rate: prompt tokens found / looked up; '-' when none."""
    if not r.prefix_queried_tokens:
        return "-"
    return f"{100 * r.prefix_hit_tokens / r.prefix_queried_tokens:.0f}% of {r.prefix_queried_tokens}"


def print_status(status) -> None:
    rows = [
        (
            "POOL",
            "REPLICA",
            "ADDRESS",
            "NODE",
            "SESSIONS",
            "STATE",
            "ENGINE",
            "MODEL",
            "DTYPE",
            "KV TOKENS",
            "PREFIX HITS",
            "METRICS",
        )
    ]
    for r in sorted(status.replicas, key=lambda r: (r.kind != "verifier", r.name)):
        rows.append(
            (
                r.kind,
                r.name,
                r.address,
                r.node[:12] or "-",
                str(r.sessions),
                "lost" if r.lost else "draining" if r.draining else "serving",
                r.engine or "-",
                r.architecture or "-",
                r.dtype or "-",
                _kv_use(r),
                _prefix_hits(r),
                r.metrics_address or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    for kind in ("verifier", "drafter"):
        serving = sum(1 for r in status.replicas if r.kind == kind and not r.draining and not r.lost)
        policy = status.autoscale.get(kind)
        print(f"{kind}s: {serving} serving" + (f", autoscaling min:max:target_sessions {policy}" if policy else ""))
    limit = f" of {status.max_active_requests}" if status.max_active_requests else ""
    print(
        f"active requests: {status.active_requests}{limit}" + ("" if status.scalable else "  (fixed pools: not on Ray)")
    )
    if len(status.orchestrators) > 1:
        print_orchestrators(status)
    elif status.metrics_address:
        print(f"orchestrator metrics: {status.metrics_address}  (all targets: specd metrics-targets)")
    for model, names in _models(status.replicas).items():
        print(f"model {model}: {', '.join(names)}")
    print_replica_notes(status.replicas)


def print_replica_notes(replicas) -> None:
    """A line per replica for what its row does not say: its drafting, its
    CUDA graphs, the fallback engine."""
    for r in sorted(replicas, key=lambda r: r.name):
        if r.drafting:
            print(f"{r.name} drafts with {r.drafting}")
        if r.cuda_graphs.startswith("on"):
            print(f"{r.name} CUDA graphs {r.cuda_graphs}")
    for r in replicas:
        if r.engine == "hf":
            print(
                f"note: {r.name} runs the Hugging Face fallback engine for {r.model_type or r.architecture} "
                "(slower than lean; docs/models.md)"
            )


def _models(replicas) -> dict[str, list[str]]:
    """Each model the replicas loaded (repo id at its commit, or directory) -> their names."""
    out: dict[str, list[str]] = {}
    for r in sorted(replicas, key=lambda r: (r.kind != "verifier", r.name)):
        if r.model:
            out.setdefault(r.model, []).append(r.name)
    return out


def print_orchestrators(status) -> None:
    """A line per orchestrator: all serve one address, each takes the
    connections the kernel hands it and admits up to its share of the limit."""
    rows = [("ORCHESTRATOR", "ADDRESS", "NODE", "PID", "REQUESTS", "STATE", "METRICS")]
    for o in status.orchestrators:
        rows.append(
            (
                o.name + (" (owner)" if o.owner else ""),
                o.address,
                o.node[:12] or "-",
                str(o.pid),
                f"{o.active_requests}/{o.max_active_requests}",
                "draining" if o.draining else "serving",
                o.metrics_address or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"answered by {status.answered_by}  (all Prometheus targets: specd metrics-targets)")

"""The `specd` command line: a sub-parser per command. `specd up` and `specd
demo` take a flag per DeploymentConfig field that has one (specd/deploy_config.py),
generated from the dataclass as the services' flags are from theirs."""

from __future__ import annotations

import argparse

from orchestrator.spec_config import METHODS, add_draft_shape_flags, parse_branching
from specd.cli.bench import cmd_bench
from specd.cli.client import cmd_generate, cmd_metrics_targets, cmd_scale, cmd_status
from specd.cli.deploy import cmd_demo, cmd_down, cmd_up
from specd.demo import DEMO_DRAFTER, DEMO_PROMPT, DEMO_TARGET
from specd.deploy_config import DeploymentConfig
from specd_core.net.auth import CLIENT_TOKEN_ENV
from specd_core.net.flags import add_flags
from specd_core.net.security import add_tls_flags
from specd_core.net.service_config import DTYPES

# `specd demo` serves on free ports, without the HTTP API: one generation over gRPC.
DEMO_SETS = ("port", "http_port", "served_model_name")
ADDRESS_HELP = "orchestrator address (default: the one `specd up` printed)"
TOKEN_HELP = f"bearer token for the public API (default: ${CLIENT_TOKEN_ENV})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="distributed speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up_parser(sub)
    _add_generate_parser(sub)
    _add_admin_parsers(sub)
    down = sub.add_parser("down", help="stop what `specd up` started")
    down.set_defaults(func=cmd_down)
    demo = sub.add_parser("demo", help="up, one generation with the demo pair, down")
    _add_deploy_flags(demo, exclude=DEMO_SETS)
    _add_generate_flags(demo)
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.set_defaults(func=cmd_demo, max_new_tokens=64)
    _add_bench_parser(sub)
    return parser


def _add_deploy_flags(p, exclude: tuple[str, ...] = ()) -> None:
    """A flag per DeploymentConfig field (those in `exclude` set by the command), and --ray-address."""
    add_flags(p, DeploymentConfig, exclude)
    p.add_argument("--ray-address", help="attach to this Ray cluster (default: $RAY_ADDRESS, else start one)")


def _add_up_parser(sub) -> None:
    up = sub.add_parser("up", help="start (or attach to) Ray and deploy; prints the Generate address")
    _add_deploy_flags(up)
    up.set_defaults(func=cmd_up)


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt", help="the prompt text; with --chat, the user's message")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message, rendered with the target's chat template (instruct models)",
    )
    gen.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's")
    gen.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="fail when the stream breaks (default: send it again, resuming after the tokens received)",
    )
    _add_generate_flags(gen)
    add_tls_flags(gen, server=False)
    g = gen.add_argument_group("per-request speculation (default: the service's config)")
    g.add_argument("--method", choices=METHODS, help=" | ".join(METHODS))
    g.add_argument("--num-speculative-tokens", type=int, help="K for this request (0 = off)")
    add_draft_shape_flags(g)
    gen.set_defaults(func=cmd_generate)


def _add_admin_parsers(sub) -> None:
    """status, scale and metrics-targets: Admin calls to the orchestrator."""
    _admin_parser(
        sub, "status", "pools, replicas, orchestrators, their nodes, addresses, sessions (of every orchestrator)"
    ).set_defaults(func=cmd_status)
    scale = _admin_parser(
        sub,
        "scale",
        "resize the drafter and/or verifier pool, or the orchestrators, live (down = drain)",
        timeout=900.0,
        timeout_help="seconds to wait for new replicas",
    )
    scale.add_argument("--drafters", type=int, help="serving drafter replicas wanted")
    scale.add_argument("--verifiers", type=int, help="serving verifier replicas wanted")
    scale.add_argument(
        "--orchestrators",
        type=int,
        help="orchestrators serving the one address (down: the removed ones stop listening and leave "
        "when their running streams have ended)",
    )
    scale.set_defaults(func=cmd_scale)
    _admin_parser(
        sub, "metrics-targets", "every Prometheus /metrics endpoint as file_sd JSON (from the orchestrator's status)"
    ).set_defaults(func=cmd_metrics_targets)


def _admin_parser(sub, name: str, help: str, timeout: float = 10.0, timeout_help: str | None = None):  # noqa: A002
    """A client command's parser: --address, --timeout, the token and TLS flags."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--address", help=ADDRESS_HELP)
    p.add_argument("--timeout", type=float, default=timeout, help=timeout_help)
    _add_client_flags(p)
    return p


def _add_client_flags(p) -> None:
    """How the client commands reach the orchestrator: TLS and the bearer token."""
    p.add_argument("--token", help=TOKEN_HELP)
    add_tls_flags(p, server=False)


def _add_generate_flags(p) -> None:
    p.add_argument("--address", help="Generate address (default: the one `specd up` printed)")
    p.add_argument("--token", help=TOKEN_HELP)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def _add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="what speculation buys on your pair and prompts: off vs on, per concurrency level",
        description="Runs the prompts at each concurrency level with speculation off and on, in alternating "
        "rounds; writes a JSON report and a PNG plot (docs/bench.md).",
    )
    b.add_argument("--address", help="benchmark this running orchestrator (default: start a local stack)")
    b.add_argument(
        "--target", default=str(DEMO_TARGET), help="local stack: target dir or repo id (org/name[@rev]; default: demo)"
    )
    b.add_argument("--drafter", default=str(DEMO_DRAFTER), help="local stack: drafter dir or repo id (default: demo)")
    b.add_argument("--allow-pickle-weights", action="store_true", help="local stack: see `specd up --help`")
    b.add_argument("--device", default="auto", help="local stack: auto | cpu | cuda")
    b.add_argument(
        "--dtype",
        default="default",
        choices=DTYPES,
        help="local stack: weights dtype (default: float32 on a CPU, the checkpoint's own on a GPU)",
    )
    b.add_argument(
        "--prompts",
        metavar="FILE",
        help='JSONL, one {"prompt": "..."} or {"messages": [...]} a line (default: the demo\'s held-out prompts)',
    )
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="streams in flight")
    b.add_argument("--methods", nargs="+", default=["draft_model"], choices=METHODS, help="speculative methods")
    b.add_argument("--k", type=int, nargs="+", default=[4], help="draft lengths (a chain setting per method and K)")
    b.add_argument(
        "--tree", type=parse_branching, metavar="B1,B2,...", help="also a tree setting: children per depth, e.g. 2,2,1"
    )
    b.add_argument(
        "--settings", metavar="FILE", help="JSON/YAML list of GenerateRequest field dicts (instead of the flags)"
    )
    b.add_argument("--rounds", type=int, default=3, help="rounds per level, the settings' order reversed every other")
    b.add_argument(
        "--requests", type=int, help="requests per setting, level and round (default: max(prompts, 2 x level))"
    )
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--request-timeout", type=float, default=600.0, help="seconds per Generate")
    b.add_argument("--out", default="bench.json", help="JSON report")
    b.add_argument("--plot", default="bench.png", help="PNG plot ('' = none; needs matplotlib: the bench extra)")
    _add_client_flags(b)
    b.set_defaults(func=cmd_bench)

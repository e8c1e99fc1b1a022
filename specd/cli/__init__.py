"""`specd` command line: up, generate, status, scale, metrics-targets, down, demo, bench.

parser.py   the sub-parsers (up/demo flags from DeploymentConfig)
deploy.py   up, down, demo
client.py   generate, status, scale, metrics-targets
status.py   status's tables
bench.py    bench
"""

from __future__ import annotations

import sys

from specd.cli.parser import build_parser
from specd.cli.status import print_status
from specd.demo import DEMO_DRAFTER, DEMO_EAGLE, DEMO_PROMPT, DEMO_TARGET
from specd.deploy_config import TARGETS_FILE_NAME

__all__ = [
    "DEMO_DRAFTER",
    "DEMO_EAGLE",
    "DEMO_PROMPT",
    "DEMO_TARGET",
    "TARGETS_FILE_NAME",
    "build_parser",
    "main",
    "print_status",
]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

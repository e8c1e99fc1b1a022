"""The speculative config, in the vocabulary of vLLM's `speculative_config`.

    method: draft_model        # draft_model | eagle | eagle3 | medusa | ngram | off
    model: models/demo/drafter # the drafter (draft_model) or the head (eagle: models/demo/eagle, or a
                               #   published EAGLE-1/2 head; eagle3: a published EAGLE-3 head;
                               #   medusa: published Medusa heads, either layout)
    num_speculative_tokens: 4  # K: chain length, or the depth limit of a tree
    prompt_lookup_max: 4       # ngram: longest suffix tried
    prompt_lookup_min: 1       # ngram: shortest suffix tried
    tree:                      # optional, draft_model / eagle / eagle3 / medusa: a static or dynamic tree
      branching: [3, 2, 1]     #   children per depth, or
      paths: [[0], [1], [0, 0]] #  node by node: choice ranks from the root, or
      node_budget: 16          #   a dynamic tree of this many nodes ...
      max_depth: 6             #   ... and this depth
      top_k: 4
    medusa_choices: [[0], [1], [0, 0]] # the Medusa authors' name for tree.paths (either, not both)
    adaptive: true             # depth per cycle from measured acceptance and costs (false: always K)
    pipeline: auto             # draft the next chain during each verify (draft_model chains):
                               # auto (while the session has its drafter to itself) | true | false
    pipeline_alternatives: 2   # ... also for this many rejection outcomes per depth (0: all-kept only)
    confidence_threshold: auto # draft nothing below a token the drafter is less sure of than this:
                               # auto (learned, adaptive requests) | a number in [0, 1) | 0 (off)

Read from YAML, TOML or JSON (`specd up --speculative-config FILE`) or flags; every
error names the key and the value. Requests may override method, K and tree
within the service's limits (GenerateRequest.speculative_method, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from specd_core.rules.draft_shape import DraftShape

METHODS = ("draft_model", "eagle", "eagle3", "medusa", "ngram", "off")
# Methods drafted by the drafter service: a draft model, or an EAGLE, EAGLE-3
# or Medusa head on the target's features (the verifier then returns them;
# drafter_svc/eagle.py, drafter_svc/medusa.py).
DRAFTER_METHODS = ("draft_model", "eagle", "eagle3", "medusa")
TREE_KEYS = ("branching", "paths", "node_budget", "max_depth", "top_k")
# Alternatives per depth a request may ask for (the drafter's own limit is
# DrafterConfig.max_ahead_alternatives, by default the same).
MAX_PIPELINE_ALTERNATIVES = 4


class ConfigError(ValueError):
    """A speculative config that cannot run; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "draft_model"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    tree: dict = field(default_factory=dict)
    # Draft depth per cycle from measured acceptance and costs, up to K (or the
    # tree's depth), 0 included (orchestrator/cycle/adaptive.py); false = always K.
    adaptive: bool = True
    # Pipelined drafting: draft the next chain while the verifier checks this
    # one (draft_model chains). Pays where the drafter has spare time: each
    # ahead call drafts 1 + N(K+1) chains, of which one at most is used, work
    # that other sessions on the same drafter would wait behind. "auto": a
    # cycle drafts ahead only while its session is the one session this
    # orchestrator has open on its drafter replica (a lone stream, the last
    # stream of a burst), and not for a sampled request with a seed of its
    # own, whose output would then depend on the load; true: every cycle;
    # false: never (docs/architecture.md, "Pipelined drafting").
    pipeline: bool | str = "auto"
    # With pipeline: per depth of the chain in flight, the drafter's next choices
    # there (besides the drafted token) pre-drafted as the verifier's possible
    # correction, and as many further bonus guesses (drafter_svc/branches.py).
    # 0 = only the all-kept branch. Default from benchmarks/pipeline.py (benchmarks/README.md).
    pipeline_alternatives: int = 2
    # The drafter drafts nothing below a token whose confidence (its own
    # probability of it) is under this; the token itself is drafted. "auto":
    # learned per cycle from acceptance per confidence bucket and the measured
    # costs, for adaptive requests (others: off); a number in [0, 1): that
    # threshold for every drafter request; 0: off (orchestrator/cycle/confidence.py).
    confidence_threshold: str | float = "auto"
    max_num_speculative_tokens: int = 16  # limits that requests cannot exceed
    max_tree_nodes: int = 64
    # Medusa's tree as its authors write it: rank paths from the root, which is
    # what tree.paths is; taken as the tree when no tree is given.
    medusa_choices: list | None = None

    def __post_init__(self):
        if self.medusa_choices and not self.tree:
            object.__setattr__(self, "tree", {"paths": self.medusa_choices})

    def validate(self) -> SpeculativeConfig:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config.method: {self.method!r} is not one of {', '.join(METHODS)}")
        for key in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "max_num_speculative_tokens",
            "max_tree_nodes",
            "pipeline_alternatives",
        ):
            if not isinstance(getattr(self, key), int) or isinstance(getattr(self, key), bool):
                raise ConfigError(f"speculative_config.{key}: must be an integer, got {getattr(self, key)!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive: must be true or false, got {self.adaptive!r}")
        if not isinstance(self.pipeline, bool) and self.pipeline != "auto":
            raise ConfigError(f'speculative_config.pipeline: must be "auto", true or false, got {self.pipeline!r}')
        check_confidence_threshold(self.confidence_threshold)
        if not 0 <= self.pipeline_alternatives <= MAX_PIPELINE_ALTERNATIVES:
            raise ConfigError(
                f"speculative_config.pipeline_alternatives: {self.pipeline_alternatives} is outside "
                f"[0, {MAX_PIPELINE_ALTERNATIVES}]"
            )
        k = self.num_speculative_tokens
        if not (0 <= k <= self.max_num_speculative_tokens):
            raise ConfigError(
                f"speculative_config.num_speculative_tokens: {k} is outside [0, {self.max_num_speculative_tokens}]"
            )
        if self.prompt_lookup_min < 1:
            raise ConfigError(f"speculative_config.prompt_lookup_min: must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is greater "
                f"than prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.medusa_choices and self.tree != {"paths": self.medusa_choices}:
            raise ConfigError("speculative_config.medusa_choices: give either it or tree, not both")
        unknown = sorted(set(self.tree) - set(TREE_KEYS))
        if unknown:
            raise ConfigError(f"speculative_config.tree.{unknown[0]}: unknown key (known: {', '.join(TREE_KEYS)})")
        if self.tree:
            if self.method not in DRAFTER_METHODS:
                raise ConfigError(
                    f"speculative_config.tree: trees need method {', '.join(DRAFTER_METHODS)}, not {self.method!r}"
                )
            try:
                tree_shape(self.tree).validate(self.max_tree_nodes, self.max_num_speculative_tokens)
            except (ValueError, TypeError) as exc:  # TypeError: paths that are not lists of ints
                raise ConfigError(f"speculative_config.tree: {exc}") from None
        return self

    def tree_shape(self) -> DraftShape | None:
        return tree_shape(self.tree) if self.tree else None

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        data = dict(data.get("speculative_config", data))  # a file may nest it
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        return cls(**data).validate()


def check_confidence_threshold(value) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(
            f'speculative_config.confidence_threshold: "auto" or a number in [0, 1) (0 = off), got {value!r}'
        )


def pipeline_arg(text: str) -> bool | str:  # argparse type
    choices: dict[str, bool | str] = {"auto": "auto", "on": True, "true": True, "off": False, "false": False}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(f"want auto, on or off; got {text!r}")
    return choices[text.lower()]


def confidence_arg(text: str) -> str | float:  # argparse type
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want auto or a number in [0, 1); got {text!r}") from None


def load(path: str | Path) -> SpeculativeConfig:
    """Read a YAML (.yaml/.yml), TOML (.toml) or JSON (.json, as vLLM's
    --speculative-config takes it) speculative config file."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        data = tomllib.loads(text)
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{path}: not JSON ({exc})") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        raise ConfigError(f"{path}: the speculative config must be .yaml, .yml, .toml or .json")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {type(data).__name__}")
    return SpeculativeConfig.from_dict(data)


def add_speculative_flags(parser) -> None:
    """Flags shared by `specd up` and `python -m orchestrator`; they override the file."""
    g = parser.add_argument_group("speculative config (vLLM vocabulary; flags override the file)")
    g.add_argument("--speculative-config", help="YAML, TOML or JSON file (see orchestrator/spec_config.py)")
    g.add_argument("--method", choices=METHODS, help=" | ".join(METHODS))
    g.add_argument("--num-speculative-tokens", type=int, help="K: chain length / tree depth limit")
    g.add_argument("--prompt-lookup-max", type=int)
    g.add_argument("--prompt-lookup-min", type=int)
    add_draft_shape_flags(g)


def add_draft_shape_flags(g) -> None:
    """Tree and adaptive-depth flags: the service's (`specd up`) and a request's (`specd generate`)."""
    g.add_argument("--tree", type=parse_branching, help="static draft tree: children per depth, e.g. 3,2,2,1")
    g.add_argument(
        "--tree-paths",
        type=tree_paths_arg,
        help="static draft tree node by node: rank paths separated by ';', e.g. '0;1;0,0;0,0,0'",
    )
    g.add_argument("--tree-budget", type=int, help="dynamic draft tree (EAGLE-2 style) of this many nodes")
    g.add_argument("--tree-depth", type=int, help="depth limit of the dynamic tree (default 6)")
    g.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose the draft depth per cycle from measured acceptance and costs (default: on, "
        "but a request that names its own K or tree gets exactly that)",
    )
    g.add_argument(
        "--pipeline",
        type=pipeline_arg,
        nargs="?",
        const=True,
        default=None,
        metavar="auto|on|off",
        help="pipelined drafting: draft the next chain while the verifier checks this one; auto (the "
        "default): while a session has its drafter replica to itself; --pipeline alone: on",
    )
    g.add_argument("--no-pipeline", dest="pipeline", action="store_const", const=False, help="--pipeline off")
    g.add_argument(
        "--pipeline-alternatives",
        type=int,
        default=None,
        help="pipelined drafting: rejection outcomes pre-drafted per chain depth (0: all-kept only)",
    )
    g.add_argument(
        "--confidence-threshold",
        type=confidence_arg,
        default=None,
        metavar="auto|X",
        help="draft nothing below a token the drafter is less sure of than this: auto (learned, for "
        "adaptive requests; the service's default), a number in [0, 1), 0 = off",
    )


def parse_branching(text: str) -> list[int]:  # argparse type, also used by the CLI
    import argparse

    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated branching factors like 3,2,1; got {text!r}") from None


def tree_paths_arg(text: str) -> list[list[int]]:  # argparse type, also used by the CLI
    import argparse

    try:
        return [[int(x) for x in path.split(",")] for path in text.split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want ';'-separated rank paths like 0;1;0,0; got {text!r}") from None


def speculative_config_from_args(args) -> SpeculativeConfig:
    base = load(args.speculative_config) if args.speculative_config else SpeculativeConfig()
    changes = {
        k: getattr(args, k)
        for k in (
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "adaptive",
            "pipeline",
            "pipeline_alternatives",
            "confidence_threshold",
        )
        if getattr(args, k, None) is not None
    }
    if args.tree or getattr(args, "tree_paths", None) or args.tree_budget:
        changes["medusa_choices"] = None  # a tree flag overrides the file's tree, medusa_choices included
    if args.tree:
        changes["tree"] = {"branching": args.tree}
    elif getattr(args, "tree_paths", None):
        changes["tree"] = {"paths": args.tree_paths}
    elif args.tree_budget:
        changes["tree"] = {"node_budget": args.tree_budget, "max_depth": args.tree_depth or 6}
    return dataclasses.replace(base, **changes).validate()


def tree_shape(t: dict) -> DraftShape:
    """The DraftShape of a speculative_config.tree (TypeError: paths that are not lists of ints)."""
    return DraftShape(
        branching=tuple(t.get("branching", ())),
        node_budget=t.get("node_budget", 0),
        max_depth=t.get("max_depth", 0),
        top_k=t.get("top_k", 4),
        paths=tuple(tuple(p) for p in t.get("paths", ())),
    )

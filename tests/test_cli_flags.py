"""One source for configuration: the flags of `python -m orchestrator`,
`python -m drafter_svc|verifier_svc` and `specd up` are generated from their
config dataclasses (specd_core/net/flags.py), and the configs are built from the
parsed flags by the same fields. These tests keep the three from drifting: every
field has a flag in its command or says why not, every flag reaches its field,
and a command has no flag beside its config's but the few listed here."""

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import pytest

from drafter_svc.config import DrafterConfig
from orchestrator import __main__ as orchestrator_main
from orchestrator.config import OrchestratorConfig
from specd.cli import build_parser
from specd.deploy_config import NOT_FOR_REPLICAS, DeploymentConfig, shared_fields
from specd_core.net import service_main
from specd_core.net.flags import Flag, FlagGroup, NotFlag, config_from_args, dest, flag_name, spec
from verifier_svc.config import VerifierConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _subparser(parser, name):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _place(name):
    """(config class, its command's parser, minimal argv, fields the command sets itself,
    the command's own flags that are no config field)."""
    if name == "orchestrator":
        return (OrchestratorConfig, orchestrator_main.parser(),
                ["--target", "t", "--verifier-address", "v:1"], (), {"--metrics-port"})
    if name in ("drafter", "verifier"):
        cls = DrafterConfig if name == "drafter" else VerifierConfig
        return (cls, service_main._build_parser(f"{name}_svc", cls), ["--model", "m"], (),
                {"--metrics-port", "--shutdown-grace"})
    if name == "specd up":
        return DeploymentConfig, _subparser(build_parser(), "up"), [], (), {"--ray-address"}
    assert name == "specd demo"
    from specd.cli.parser import DEMO_SETS

    own = {"--ray-address", "--prompt", "--address", "--token", "--max-new-tokens", "--temperature",
           "--top-p", "--top-k", "--seed", "--stop"}
    return DeploymentConfig, _subparser(build_parser(), "demo"), [], DEMO_SETS, own


PLACES = ["orchestrator", "drafter", "verifier", "specd up", "specd demo"]


def _options(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def _group_options(group: FlagGroup) -> set[str]:
    scratch = argparse.ArgumentParser(add_help=False)
    group.add(scratch)
    return _options(scratch)


@pytest.mark.parametrize("place", PLACES)
def test_every_field_is_a_flag_or_says_why_not(place):
    cls, parser, _, exclude, own = _place(place)
    options = _options(parser)
    expected = set(own)
    for f in dataclasses.fields(cls):
        s = spec(f)  # a field with no flag metadata raises here
        if isinstance(s, NotFlag):
            assert s.reason.strip(), f"{cls.__name__}.{f.name}: not a flag, but no reason given"
        elif f.name in exclude:
            assert flag_name(f) not in options, f"{place} sets {f.name} itself but also has its flag"
        elif isinstance(s, FlagGroup):
            expected |= _group_options(s)
        else:
            assert flag_name(f) in options, f"{cls.__name__}.{f.name}: no {flag_name(f)} in {place}"
            expected.add(flag_name(f))
    # Nothing beside the config's flags but the command's own, listed above:
    # a flag written by hand for a config field would show up here.
    assert options == expected


@pytest.mark.parametrize("place", PLACES)
def test_the_defaults_are_the_fields_defaults(place):
    cls, parser, argv, _, _ = _place(place)
    args = parser.parse_args(argv)
    for f in dataclasses.fields(cls):
        s = spec(f)
        if not isinstance(s, Flag) or s.options.get("required") or not hasattr(args, dest(f)):
            continue
        field_default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        want = s.options.get("default", field_default)
        assert getattr(args, dest(f)) == want, f"{place} {flag_name(f)}"


def _value_for(f, s: Flag, hint):
    """A command-line value other than the default, and what the field gets."""
    if s.options.get("action") in ("store_true", "store_false"):
        return [], s.options["action"] == "store_true"
    if s.options.get("action") == "append":
        return ["a:1", flag_name(f), "b:2"], ["a:1", "b:2"]
    if s.options.get("choices"):
        choice = list(s.options["choices"])[-1]
        return [choice], choice
    if "int" in hint:
        return ["7"], 7
    if "float" in hint:
        return ["0.25"], 0.25
    return ["/some/value"], "/some/value"


@pytest.mark.parametrize("place", PLACES)
def test_every_flag_reaches_its_field(place):
    """The config built from the parsed flags has each flag's value in its field."""
    cls, parser, argv, exclude, _ = _place(place)
    given = {"target_dir": "t", "drafter_dir": None} if cls is DeploymentConfig else {}
    for f in dataclasses.fields(cls):
        s = spec(f)
        if not isinstance(s, Flag) or f.name in exclude or f.name in given:
            continue
        words, want = _value_for(f, s, str(f.type))
        if f.name == "kv_cache_memory":
            words, want = ["2GiB"], "2GiB"
        if s.options.get("action") == "append":  # after any the minimal command line gives
            want = [*(getattr(parser.parse_args(argv), dest(f)) or []), *want]
        parsed = parser.parse_args([*argv, flag_name(f), *words])
        config = config_from_args(cls, parsed, **given)
        assert getattr(config, f.name) == want, f"{place} {flag_name(f)} {words}"


def test_groups_are_read_into_their_fields():
    """TLS, the speculative config and the autoscaling policies: several flags, one field."""
    args = _subparser(build_parser(), "up").parse_args([
        "--tls-cert", "c.pem", "--tls-key", "k.pem", "--method", "ngram", "--num-speculative-tokens", "3",
        "--autoscale-verifiers", "1:4:8", "--hang-floor", "2", "--hang-ceiling", "9"])
    cfg = config_from_args(DeploymentConfig, args, target_dir="t", drafter_dir=None)
    assert cfg.tls is not None and cfg.tls.cert.endswith("c.pem")
    assert (cfg.speculative.method, cfg.speculative.num_speculative_tokens) == ("ngram", 3)
    assert set(cfg.autoscale) == {"verifier"}
    assert (cfg.hang.floor_s, cfg.hang.ceiling_s, cfg.hang.multiple) == (2.0, 9.0, 10.0)
    assert shared_fields(cfg, OrchestratorConfig)["hang"] == cfg.hang   # reaches the orchestrators on Ray
    args = orchestrator_main.parser().parse_args(["--target", "t", "--verifier-address", "v:1", "--tree", "2,1",
                                                  "--hang-multiple", "0"])
    orch = orchestrator_main.config_from_args(args, None)
    assert orch.speculative.tree == {"branching": [2, 1]}
    assert not orch.hang.enabled and orch.hang.floor_s == 5.0


def test_the_deployment_hands_its_fields_on_by_name():
    """The orchestrator's and the replicas' configs take what the deployment
    says by the fields they share with it; none is dropped on the way."""
    cfg = DeploymentConfig(target_dir="/t", drafter_dir="/d", port=1234, http_port=0, max_active_requests=7,
                           dtype="bfloat16", kv_block_size=32, engine="hf", max_message_bytes=99)
    orch = shared_fields(cfg, OrchestratorConfig)
    assert {"target_dir", "drafter_dir", "port", "http_port", "max_active_requests", "speculative", "tls",
            "autoscale", "auth_tokens_file", "max_message_bytes", "metrics_targets_file",
            "served_model_name", "hang"} <= set(orch)
    assert OrchestratorConfig(**orch).port == 1234
    for cls in (VerifierConfig, DrafterConfig):
        replica = shared_fields(cfg, cls, exclude=NOT_FOR_REPLICAS)
        assert (replica["dtype"], replica["kv_block_size"], replica["engine"]) == ("bfloat16", 32, "hf")
        assert not set(replica) & set(NOT_FOR_REPLICAS)


def test_replica_and_orchestrator_configs_on_ray():
    ray_deploy = pytest.importorskip("specd.ray_deploy")
    cfg = DeploymentConfig(target_dir="/t", drafter_dir="/d", port=1234, max_active_requests=7, replica_host="h")
    orch = ray_deploy.orchestrator_config(cfg, [])
    assert (orch.port, orch.max_active_requests, orch.admission_total, orch.drafter_dir) == (1234, 7, 7, "/d")
    fields = ray_deploy.replica_fields(cfg, "drafter")
    assert (fields["model_dir"], fields["host"], fields["port"]) == ("/d", "h", 0)
    assert DrafterConfig(**fields).target_dir == ""  # the head's own target, not the deployment's
    assert VerifierConfig(**ray_deploy.replica_fields(cfg, "verifier")).model_dir == "/t"


def test_the_dtype_choices_are_the_loaders():
    from specd_core.net.service_config import DTYPES
    from specd_core.runtime.models import DTYPE_CHOICES

    assert sorted(DTYPES) == sorted(DTYPE_CHOICES)


RUNTIME = ("specd_core", "drafter_svc", "verifier_svc", "orchestrator", "specd")


def test_the_runtime_imports_neither_training_nor_benchmarks():
    found = []
    for package in RUNTIME:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.split(".")[0] in ("training", "benchmarks")]
    assert not found


def test_the_demo_bench_prompts_are_the_demo_tokenizers():
    """models/demo/bench_prompts.jsonl: 16 prompts of 96 tokens, their text the
    demo tokenizer's reading of their ids (training/bench_prompts.py writes it)."""
    from specd.bench import demo_prompts
    from specd.demo import BENCH_PROMPTS, DEMO_TARGET, bench_prompts
    from specd_core.runtime.models import load_tokenizer

    prompts = bench_prompts()
    assert len(prompts) == 16 and all(len(p["ids"]) == 96 for p in prompts)
    tok = load_tokenizer(str(DEMO_TARGET))
    assert all(tok.decode(p["ids"]) == p["text"] for p in prompts)
    assert demo_prompts(str(DEMO_TARGET)) == [{"prompt_token_ids": {"ids": p["ids"]}} for p in prompts]
    assert all(set(json.loads(line)) == {"ids", "text"} for line in BENCH_PROMPTS.read_text().splitlines())

"""deploy/cluster.yaml (AWS) and deploy/cluster-local.yaml (on-prem) cannot be
launched here (no cloud account, no machines): check them with the validation
`ray up` itself runs, then check what specd relies on: which node type offers
which pool, what the head starts, and that the `specd up` it runs parses with
specd's own parser."""
import copy
import re
import shlex
from pathlib import Path

import click
import jsonschema
import pytest
import tomllib
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CLUSTER_FILES = ("cluster.yaml", "cluster-local.yaml")
POOLS = {"drafter_pool": "drafter", "verifier_pool": "verifier"}


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def ray_up_checks(raw: dict) -> dict:
    """What `ray up` does to a config before it talks to the provider
    (commands.create_or_update_cluster -> _bootstrap_config): prepare_config
    merges in the provider's defaults and setup_commands and sets per-type
    min/max workers (for `local` it first builds the single node type from
    head_ip / worker_ips), then validate_config checks the result against
    ray-schema.json and the cross-field rules. Left out, as they need the cloud:
    the provider's fillout_available_node_types_resources (AWS instance types
    through boto3; `ray up` only warns when it fails) and bootstrap_config (IAM,
    key pairs, subnets, security groups)."""
    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    return config


def script(config: dict) -> str:
    return "\n".join(config["head_start_ray_commands"])


def specd_up_argv(config: dict) -> list[str]:
    """The `specd up` the head runs: the end of its detached job's script."""
    m = re.search(r"\bspecd up [^']*", script(config))
    assert m, "no `specd up` in head_start_ray_commands"
    return shlex.split(m.group(0))


def awaited_pools(config: dict) -> dict[str, float]:
    """The pool resources the head waits for before `specd up` (the arguments
    after the wait loop's `python -c "..."`)."""
    m = re.search(r'python -c "[^"]*"((?: \w+ [\d.]+)+)', script(config))
    assert m, "no wait for the pools before `specd up`"
    words = m.group(1).split()
    return {k: float(n) for k, n in zip(words[::2], words[1::2])}


def parse_specd_up(config: dict):
    from specd.cli import build_parser

    argv = specd_up_argv(config)
    assert argv[:2] == ["specd", "up"]
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"specd's parser rejects `{shlex.join(argv)}` (its message is in the captured stderr)")


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_ray_up_accepts_the_config(name):
    config = ray_up_checks(load(name))
    assert config["cluster_name"].startswith("specd")
    assert config["head_node_type"] in config["available_node_types"]


def test_the_validation_really_runs():
    """Copies with one mistake each are rejected, so the test above would catch
    them: the schema (unknown keys, types) and the cross-field rules."""
    raw = load("cluster.yaml")
    bad_top_level = dict(raw, min_worker=1)
    fractional_resource = copy.deepcopy(raw)
    fractional_resource["available_node_types"]["drafter_pool"]["resources"]["drafter"] = 0.5
    bad_node_type_key = copy.deepcopy(raw)
    bad_node_type_key["available_node_types"]["verifier_pool"]["min_worker"] = 1
    for bad in (bad_top_level, fractional_resource, bad_node_type_key):
        with pytest.raises(jsonschema.ValidationError):
            ray_up_checks(bad)
    with pytest.raises(ValueError, match="head_node_type"):
        ray_up_checks(dict(raw, head_node_type="gpu_head"))
    with pytest.raises(ValueError, match="min_workers"):
        ray_up_checks(dict(raw, max_workers=1))

    local = load("cluster-local.yaml")
    with pytest.raises(jsonschema.ValidationError):
        ray_up_checks(dict(local, worker_ip=["192.0.2.99"]))
    # The local provider takes no node types of its own: why the pools are
    # declared per host in that file.
    with pytest.raises(click.ClickException):
        ray_up_checks(dict(local, available_node_types=raw["available_node_types"], head_node_type="head"))


def test_each_pool_offers_only_its_own_resource():
    config = ray_up_checks(load("cluster.yaml"))
    types = config["available_node_types"]
    assert set(types) == {config["head_node_type"], *POOLS}
    head = types[config["head_node_type"]]["resources"]
    assert not {"drafter", "verifier"} & set(head), "replicas must never land on the head"
    args = parse_specd_up(config)
    for pool, resource in POOLS.items():
        res = types[pool]["resources"]
        assert res.get(resource, 0) >= 1 and res.get("GPU", 0) >= 1
        other = set(POOLS.values()) - {resource}
        assert not other & set(res), f"{pool} must not offer {other}"
        # Every unit of the pool can host a replica: enough GPUs behind it.
        assert 0 < res[resource] * args.replica_gpus <= res["GPU"]


def test_the_initial_deployment_fits_the_minimum_pools():
    """The replicas `specd up` deploys at start fit on the pools' min_workers
    nodes, and the head waits for exactly those resources."""
    config = ray_up_checks(load("cluster.yaml"))
    types = config["available_node_types"]
    args = parse_specd_up(config)
    wanted = {"verifier": args.verifiers, "drafter": args.drafters}
    for pool, resource in POOLS.items():
        assert types[pool]["min_workers"] * types[pool]["resources"][resource] >= wanted[resource]
        assert types[pool]["max_workers"] >= types[pool]["min_workers"]
    assert awaited_pools(config) == wanted
    assert awaited_pools(ray_up_checks(load("cluster-local.yaml"))) == wanted


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_the_head_starts_ray_jaeger_then_specd(name):
    config = ray_up_checks(load(name))
    cmds = config["head_start_ray_commands"]
    assert cmds[0] == "ray stop"

    def index(pattern):
        found = [i for i, c in enumerate(cmds) if re.search(pattern, c)]
        assert found, f"no head start command matches {pattern!r}"
        return found[0]

    ray_start, jaeger, specd_up = index(r"ray start --head\b"), index(r"jaeger-all-in-one"), index(r"\bspecd up\b")
    assert ray_start < jaeger < specd_up
    # Without it the head's autoscaler launches no worker.
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in cmds[ray_start]
    assert "COLLECTOR_OTLP_ENABLED=true" in cmds[jaeger]
    assert re.search(r"OTEL_EXPORTER_OTLP_ENDPOINT=http://.+?:4317 specd up ", cmds[specd_up])
    # The Jaeger the head downloads is the release docker-compose runs.
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    version = compose["services"]["jaeger"]["image"].split(":")[1]
    setup = "\n".join(config["head_setup_commands"])
    assert f"/download/v{version}/jaeger-{version}-linux-amd64.tar.gz" in setup


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_specd_up_parses_with_specds_parser(name):
    args = parse_specd_up(ray_up_checks(load(name)))
    assert args.command == "up"
    assert args.ray_address == "auto" and args.port == 50051
    assert args.device == "cuda" and args.dtype == "bfloat16" and args.replica_gpus == 1
    assert args.verifiers >= 1 and args.drafters >= 1 and args.target and args.drafter


def test_workers_join_with_their_pools_resources():
    # AWS: the launcher passes each node type's `resources` to `ray start`
    # (RAY_OVERRIDE_RESOURCES), so the start command must not set its own.
    aws = ray_up_checks(load("cluster.yaml"))["worker_start_ray_commands"]
    start = [c for c in aws if "ray start" in c]
    assert len(start) == 1 and "--address=$RAY_HEAD_IP:6379" in start[0] and "--resources" not in start[0]
    # local: no injection, each host declares its pool itself.
    local = ray_up_checks(load("cluster-local.yaml"))["worker_start_ray_commands"]
    start = [c for c in local if "ray start" in c]
    assert len(start) == 1 and "--address=$RAY_HEAD_IP:6379" in start[0]
    assert '--resources="$(cat ~/specd-pool.json)"' in start[0]


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_every_node_installs_the_project(name):
    raw = load(name)
    config = ray_up_checks(raw)
    # Every mount of the source exists, and covers what deploy/Dockerfile copies
    # into its image. (The Ray token is the user's own file, made before `ray up`:
    # test_every_node_gets_the_ray_token_by_file_mount.)
    mounted = set()
    for remote, local in config["file_mounts"].items():
        if remote == "~/.specd/ray_auth_token":
            continue
        assert remote.startswith("~/specd/") and (ROOT / local).exists(), (remote, local)
        mounted.add((ROOT / local).resolve())
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).resolve() in mounted, f"{src} is in the image but not on the cluster"
    # The install runs on the head and, through the anchor, on every pool.
    install = raw["setup_commands"][0]
    assert "scripts/setup.sh" in install
    assert config["head_setup_commands"][0] == install
    for node_type in config["available_node_types"].values():
        assert node_type.get("worker_setup_commands", config["worker_setup_commands"])[0] == install
    # Ray on the nodes is the version the project pins.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ray_pin = next(d for d in deps if d.startswith("ray=="))
    assert f'"ray[default]=={ray_pin.split("==")[1]}"' in install


def test_the_models_land_where_specd_up_looks():
    config = ray_up_checks(load("cluster.yaml"))
    args = parse_specd_up(config)
    types = config["available_node_types"]
    # Each pool fetches its own model into the directory `specd up` names.
    assert types["verifier_pool"]["worker_setup_commands"][-1].split()[-1] == args.target
    assert types["drafter_pool"]["worker_setup_commands"][-1].split()[-1] == args.drafter
    # The head fetches both (without weights: it reads tokenizers and configs).
    head_sync = next(c for c in config["head_setup_commands"] if "s3 sync" in c)
    names = re.search(r"for (\w+) in ([\w ]+); do", head_sync)
    var, models = names.group(1), names.group(2).split()
    dest = re.search(r"s3://\S+ (\S+)", head_sync).group(1)
    assert {dest.replace(f"${var}", m) for m in models} == {args.target, args.drafter}
    assert '--exclude "*.safetensors"' in head_sync


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_every_node_gets_the_ray_token_by_file_mount(name):
    """Ray's token authentication on every node: the token file travels by the
    launcher's file_mounts (never in the image or the repository), is locked
    to its owner, and every launcher shell exports RAY_AUTH_MODE=token with its
    path; no Ray listener is opened to every interface."""
    config = ray_up_checks(load(name))
    target = "~/.specd/ray_auth_token"
    assert config["file_mounts"].get(target) == "./deploy/ray_auth_token"
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/deploy/ray_auth_token" in ignored
    commands = "\n".join(config["setup_commands"] + [
        c for t in config["available_node_types"].values() for c in t.get("worker_setup_commands", [])])
    for node_type in config["available_node_types"].values():  # workers replace the setup commands
        setup = node_type.get("worker_setup_commands", config["setup_commands"])
        assert any(f"chmod 600 {target}" in c for c in setup), node_type
        assert any(f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={target}" in c and ".bashrc" in c for c in setup)
    assert "0.0.0.0" not in commands + script(config) + "\n".join(config["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in script(config)

"""deploy/docker-compose.yaml cannot be run here (no Docker): check that it
parses, that what it references exists, and that its commands parse with the
services' own flags. Likewise deploy/prometheus.yml and the Grafana dashboard
deploy/grafana/specd.json (no Prometheus or Grafana here): their shape and that
every query parses as PromQL."""
import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def test_compose_parses_and_references_existing_files():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"jaeger", "verifier", "drafter", "orchestrator"}
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert {"127.0.0.1:16686:16686", "127.0.0.1:4317:4317"} <= set(jaeger["ports"])
    # Every port is published on the host's loopback only.
    assert all(port.startswith("127.0.0.1:") for svc in services.values() for port in svc.get("ports", []))
    for name in ("verifier", "drafter", "orchestrator"):
        svc = services[name]
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        context = (DEPLOY / svc["build"]["context"]).resolve()
        assert context == ROOT and (context / svc["build"]["dockerfile"]).is_file()
    # Every COPY source of the Dockerfile exists in the build context.
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src


class _Parsed(Exception):
    pass


def test_compose_commands_parse_with_the_services_flags(monkeypatch):
    """Each command's flags are ones its service accepts (argparse exits 2 on
    an unknown flag); stop right after parsing, before anything loads."""
    from drafter_svc.config import DrafterConfig
    from orchestrator.__main__ import main as orchestrator_main
    from specd_core.net.service_main import model_service_main
    from verifier_svc.config import VerifierConfig

    real_parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real_parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    mains = {"orchestrator": orchestrator_main,
             "verifier_svc": lambda a: model_service_main("verifier_svc", VerifierConfig, None, a),
             "drafter_svc": lambda a: model_service_main("drafter_svc", DrafterConfig, None, a)}
    services = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())["services"]
    for name in ("verifier", "drafter", "orchestrator"):
        # ${VAR:-default} as compose expands it with VAR unset.
        argv = shlex.split(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", services[name]["command"]))
        assert argv[:2] == ["python", "-m"] and argv[2] in mains
        with pytest.raises(_Parsed) as parsed:
            mains[argv[2]](argv[3:])
        assert parsed.value.args[0].metrics_port > 0


# -- Prometheus and Grafana (deploy/prometheus.yml, deploy/grafana/specd.json) --
# Which metrics the dashboard's queries use is checked against what the running
# services export in tests/test_metrics.py; here the files' own shape.

DASHBOARD = DEPLOY / "grafana" / "specd.json"
# Panels the dashboard must have (docs/metrics.md describes them).
PANELS = {"Tokens/s", "Acceptance rate per position", "Mean accepted length", "Drafts per cycle",
          "Draft tokens per draft", "Verify batch size", "KV cache usage", "Sessions per replica",
          "Cycle latency p50 / p90 / p99", "Failovers", "Time to first token", "Inter-token latency"}
# Grafana's interval variables, as a query sends them to Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def dashboard_panels(dashboard=None) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    dashboard = dashboard or json.loads(DASHBOARD.read_text())
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def dashboard_exprs(dashboard=None) -> list[tuple[str, str]]:
    """(panel title, PromQL expr) of every query, Grafana's variables substituted."""
    out = []
    for p in dashboard_panels(dashboard):
        for t in p.get("targets", []):
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((p["title"], expr))
    return out


def selector_names(expr: str) -> set[str]:
    """The metric (series) names an expression selects, from its parsed AST
    (promql-parser: Prometheus's own grammar; a syntax error raises)."""
    import promql_parser

    names = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_dashboard_is_a_grafana_dashboard_on_a_prometheus_variable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    [var] = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${" + var["name"] + "}"}
    panels = dashboard_panels(dash)
    assert len({p["id"] for p in panels}) == len(panels)                    # ids unique
    graphs = [p for p in panels if p["type"] != "row"]
    assert {p["title"] for p in graphs} >= PANELS
    for p in graphs:
        assert p["datasource"] == ds and p["targets"], p["title"]
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs) and all(t["datasource"] == ds for t in p["targets"]), p["title"]
    # No two panels overlap on the 24-column grid.
    cells = [(p["title"], x, y) for p in panels for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
             for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])]
    assert len({c[1:] for c in cells}) == len(cells)
    exprs = dashboard_exprs(dash)
    for title, expr in exprs:
        assert "$" not in expr, (title, expr)                              # every variable substituted
        assert selector_names(expr), (title, expr)                         # parses, selects something
    with pytest.raises(ValueError):
        selector_names("rate(specdec:generation_tokens_total[1m]")        # the parser does catch errors


def test_prometheus_config_discovers_the_targets_file():
    from specd.cli import TARGETS_FILE_NAME

    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "specd"]
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files and all(f.endswith(TARGETS_FILE_NAME) for f in files)
    assert "static_configs" not in job                                     # only what the orchestrator lists

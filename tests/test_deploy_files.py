"""deploy/docker-compose.yaml cannot be run here (no Docker): check that it
parses, that what it references exists, and that its commands parse with the
services' own flags."""
import argparse
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
    assert {"16686:16686", "4317:4317"} <= set(jaeger["ports"])
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
    from specd.drafter.config import DrafterConfig
    from specd.net.service_main import model_service_main
    from specd.orchestrator.__main__ import main as orchestrator_main
    from specd.verifier.config import VerifierConfig

    real_parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real_parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    mains = {"specd.orchestrator": orchestrator_main,
             "specd.verifier": lambda a: model_service_main("specd.verifier", VerifierConfig, None, a),
             "specd.drafter": lambda a: model_service_main("specd.drafter", DrafterConfig, None, a)}
    services = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())["services"]
    for name in ("verifier", "drafter", "orchestrator"):
        # ${VAR:-default} as compose expands it with VAR unset.
        argv = shlex.split(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", services[name]["command"]))
        assert argv[:2] == ["python", "-m"] and argv[2] in mains
        with pytest.raises(_Parsed) as parsed:
            mains[argv[2]](argv[3:])
        assert parsed.value.args[0].metrics_port > 0

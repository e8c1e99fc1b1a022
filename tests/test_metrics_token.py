"""The Prometheus endpoints with $SPECD_METRICS_TOKEN set: a real verifier and
orchestrator, each on its own port, answer /metrics only to a request bearing
the token (401 without it or with another), and serve as before otherwise.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from specd.local_stack import ServiceProcess
from specd_core.telemetry.metrics import METRICS_TOKEN_ENV

pytestmark = pytest.mark.services

TOKEN = "s3cret-scrape-token"


def _get(address: str, token: str | None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{address}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_need_the_token_when_one_is_set(pairs):
    target, _ = pairs["llama"]
    env = {METRICS_TOKEN_ENV: TOKEN}
    verifier = ServiceProcess("verifier_svc", "--model", target, "--metrics-port", "0", "--no-warmup", env=env)
    orch = None
    try:
        orch = ServiceProcess("orchestrator", "--target", target, "--verifier-address", verifier.address,
                              "--num-speculative-tokens", "0", "--metrics-port", "0", env=env)
        for proc, name in ((verifier, "specdec:kv_cache_tokens"), (orch, "specdec:time_to_first_token_seconds")):
            assert proc.metrics_address is not None
            for token in (None, "wrong", TOKEN[:-1]):
                code, body = _get(proc.metrics_address, token)
                assert code == 401 and "bearer token" in body, (proc.metrics_address, token, code)
            code, body = _get(proc.metrics_address, TOKEN)
            assert code == 200 and name in body, body[:300]
    finally:
        if orch is not None:
            orch.stop()
        verifier.stop()


def test_metrics_are_open_without_a_token(pairs):
    target, _ = pairs["llama"]
    verifier = ServiceProcess("verifier_svc", "--model", target, "--metrics-port", "0", "--no-warmup",
                              env={METRICS_TOKEN_ENV: ""})
    try:
        code, body = _get(verifier.metrics_address, None)
        assert code == 200 and "specdec:kv_cache_tokens" in body
    finally:
        verifier.stop()

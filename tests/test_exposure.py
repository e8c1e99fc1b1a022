"""Closed by default, the pure parts: which addresses are loopback, when
serving beyond it is refused (no tokens, no mutual TLS) or only warned about
(--insecure); the Ray token file and environment `specd up` gives its cluster;
how a model argument is read (repo id or directory, revision, the cache
layout). And `python -m orchestrator --host 0.0.0.0` without credentials
exits 2 with the reason before loading anything."""

import os
import subprocess
import sys

import pytest

from specd import ray_cluster
from specd_core.net.exposure import check_exposure, is_loopback
from specd_core.net.security import SecurityConfigError, TlsConfig
from specd_core.runtime.hub import ModelSpecError, check_model_dir, looks_like_repo_id, model_label, split_spec

MTLS = TlsConfig(cert="c.pem", key="k.pem", ca="ca.pem", require_client_cert=True)


@pytest.mark.unit
@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.0.2.2", False), ("example.com", False),
])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.unit
def test_beyond_loopback_needs_tokens_or_mutual_tls_or_insecure():
    assert check_exposure("127.0.0.1", None, False, False) is None
    assert check_exposure("0.0.0.0", None, True, False) is None  # tokens
    assert check_exposure("0.0.0.0", MTLS, False, False) is None  # client certificates
    for tls in (None, TlsConfig(cert="c.pem", key="k.pem")):  # TLS alone authenticates nobody
        with pytest.raises(SecurityConfigError, match=r"refusing to serve Generate and the HTTP API on 0\.0\.0\.0 "
                           r"without authentication.*--auth-tokens-file.*--tls-client-auth.*--insecure"):
            check_exposure("0.0.0.0", tls, False, False)
    warning = check_exposure("10.0.0.5", None, False, True)
    assert warning.startswith("warning: --insecure: serving Generate and the HTTP API on 10.0.0.5 without auth")


@pytest.mark.unit
def test_the_ray_token_is_private_and_kept(tmp_path):
    path = ray_cluster.ensure_token(tmp_path / "home" / "ray_auth_token")
    token = path.read_text()
    assert len(token) == 64 and path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)  # as Ray writes its own: locked down, not replaced
    assert ray_cluster.ensure_token(path).read_text() == token and path.stat().st_mode & 0o777 == 0o600
    assert ray_cluster.ray_env(path, loopback=True) == {
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in ray_cluster.ray_env(path, loopback=False)


@pytest.mark.unit
def test_model_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "target").mkdir(parents=True)
    assert looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and looks_like_repo_id("gpt2@v1")
    assert not looks_like_repo_id("models/target")  # exists
    assert not looks_like_repo_id("models/targt")  # a typo inside an existing directory
    assert not looks_like_repo_id("./x") and not looks_like_repo_id("/abs/x") and not looks_like_repo_id("a/b/c")
    assert split_spec("org/name@v2") == ("org/name", "v2") and split_spec("org/name", "v3") == ("org/name", "v3")
    with pytest.raises(ModelSpecError, match="revision v2 in the name and v3 given apart"):
        split_spec("org/name@v2", "v3")
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / ("c" * 40)
    assert model_label(str(snapshot)) == "org/name@" + "c" * 40
    assert model_label("/data/target") == "/data/target"
    d = tmp_path / "models" / "target"
    with pytest.raises(ModelSpecError, match=r"not a Hugging Face model directory \(no config.json\)"):
        check_model_dir(d, False, "--target x")
    (d / "config.json").write_text("{}")
    check_model_dir(d, False, "--target x")  # no weights here: a head's copy (configs, tokenizer)
    (d / "model.pt").write_bytes(b"")
    with pytest.raises(ModelSpecError, match=r"only pickle weights \(model.pt\), no safetensors: .*--allow-pickle"):
        check_model_dir(d, False, "--target x")
    check_model_dir(d, True, "--target x")
    check_model_dir(d, False, "--target x", weights=False)  # the orchestrator reads no weights


@pytest.mark.services
def test_the_orchestrator_refuses_an_open_public_address(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPECD_AUTH_TOKENS"}
    r = subprocess.run([sys.executable, "-m", "orchestrator", "--target", "models/demo/target", "--verifier-address",
                        "127.0.0.1:1", "--host", "0.0.0.0", "--port", "0", "--http-port", "0"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("orchestrator: refusing to serve Generate and the HTTP API on 0.0.0.0"), r.stderr

"""Security: TLS with mutual TLS on every gRPC link, bearer tokens on the
public API, message size limits, health over TLS, graceful drain - on real
processes and ports.

The secure stack runs mTLS on all three servers (so the orchestrator's channels
to the replicas are TLS with its client certificate, or nothing would stream),
tokens on the orchestrator and a 64 KiB message limit there. The plain stack
(verifier + orchestrator, speculation off: target-only decoding) is the
reference output and the process the drain test stops.
"""
import os
import signal
import ssl
import threading
import time
from pathlib import Path

import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd import cli
from specd.local_stack import ServiceProcess, Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.auth import bearer_metadata, check_metadata, load_tokens
from specd_core.net.grpc_util import open_channel
from specd_core.net.security import SecurityConfigError, TlsConfig
from tests.certs import make_pki

TOKEN = "s3cret-token-1"
PROMPT = [40, 41, 42, 43, 44, 45]
MAX_MESSAGE = 64 * 1024


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def client_tls(pki):
    return TlsConfig(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)


@pytest.fixture(scope="module")
def secure(pairs, pki, client_tls, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(f"# accepted tokens\n{TOKEN}\n\nother-token\n")
    tls_flags = ("--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-ca", pki.ca,
                 "--tls-client-auth")
    target, drafter = pairs["llama"]
    stack = Stack(target, drafter, service_args=tls_flags, client_tls=client_tls, http=True,
                  orchestrator_args=(*tls_flags, "--auth-tokens-file", str(tokens),
                                     "--max-message-bytes", str(MAX_MESSAGE)))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def plain(pairs):
    target, _ = pairs["llama"]
    stack = Stack(target, None, orchestrator_args=("--method", "off"))
    yield stack
    stack.stop()


def request(**fields):
    if "prompt" not in fields:
        fields["prompt_token_ids"] = pb.PromptTokenIds(ids=PROMPT)
    fields.setdefault("max_new_tokens", 24)
    return pb.GenerateRequest(**fields)


def stream(channel, token=TOKEN, **fields):
    chunks = list(pb_grpc.OrchestratorServiceStub(channel).Generate(
        request(**fields), timeout=60, metadata=bearer_metadata(token)))
    return [t for c in chunks for t in c.token_ids], chunks


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def health(channel, service=""):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status


@pytest.mark.services
def test_mtls_on_every_link_streams_the_plain_stacks_greedy_output(secure, plain):
    want, _ = stream(plain.channel, token=None)
    got, chunks = stream(secure.channel, num_speculative_tokens=3)
    assert len(chunks) > 1 and chunks[-1].finish_reason == "length"
    assert chunks[-1].stats.drafted_tokens > 0            # the drafter link (TLS) was used
    assert got == want and len(want) == 24


@pytest.mark.services
def test_replicas_serve_only_mtls(secure, pki, client_tls):
    """The orchestrator streams above through these servers, so its links are mTLS."""
    for proc in (secure.verifier, secure.drafter_proc):
        with grpc.insecure_channel(proc.address) as ch:
            assert refused(lambda: health(ch)).code() == grpc.StatusCode.UNAVAILABLE
        with open_channel(proc.address, TlsConfig(ca=pki.ca)) as ch:        # no client certificate
            assert refused(lambda: health(ch)).code() == grpc.StatusCode.UNAVAILABLE
        with open_channel(proc.address, client_tls) as ch:
            assert health(ch) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.services
def test_client_without_the_ca_or_without_a_client_cert_is_refused(secure, pki):
    address = secure.orchestrator.address
    clients = {"plaintext": grpc.insecure_channel(address),
               "system roots, no CA": open_channel(address, TlsConfig(cert=pki.client_cert, key=pki.client_key)),
               "CA but no client cert (mTLS)": open_channel(address, TlsConfig(ca=pki.ca))}
    for label, ch in clients.items():
        with ch:
            err = refused(lambda: stream(ch))
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (label, err)


@pytest.mark.services
def test_tokens(secure):
    stub = pb_grpc.AdminServiceStub(secure.channel)
    for token, why in ((None, "missing bearer token"), ("wrong-token", "invalid bearer token"),
                       (TOKEN[:-1], "invalid bearer token")):
        err = refused(lambda: stream(secure.channel, token=token))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and why in err.details(), (token, err)
        err = refused(lambda: stub.Status(pb.StatusRequest(), timeout=30, metadata=bearer_metadata(token)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, token
    err = refused(lambda: next(pb_grpc.OrchestratorServiceStub(secure.channel).Generate(
        request(), timeout=30, metadata=(("authorization", f"Basic {TOKEN}"),))))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in err.details()
    # Both tokens of the file are accepted, the comment line is not a token.
    assert len(stream(secure.channel, token="other-token")[0]) == 24
    assert refused(lambda: stream(secure.channel, token="# accepted tokens")).code() == \
        grpc.StatusCode.UNAUTHENTICATED
    assert stub.Status(pb.StatusRequest(), timeout=30, metadata=bearer_metadata(TOKEN)).active_requests == 0


@pytest.mark.services
def test_http_api_over_mtls_with_tokens(secure, pki):
    """The OpenAI-compatible API takes the gRPC side's certificates (client
    certificates required too) and its tokens."""
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.load_cert_chain(pki.client_cert, pki.client_key)
    url, model = secure.openai_base_url, Path(secure.target).name
    assert url.startswith("https://")
    want = "".join(c.text for c in stream(secure.channel, num_speculative_tokens=3)[1])
    with httpx2.Client(verify=ctx, timeout=60) as http:
        # Not closed by a `with`: an OpenAI client closes the http client it was given.
        client = openai.OpenAI(base_url=url, api_key=TOKEN, http_client=http, max_retries=0)
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"num_speculative_tokens": 3})
        assert r.choices[0].text == want and r.usage.completion_tokens == 24
        for token, why in (("wrong-token", "invalid bearer token"), (TOKEN[:-1], "invalid bearer token")):
            client = openai.OpenAI(base_url=url, api_key=token, http_client=http, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as info:
                client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
            assert info.value.body["code"] == "invalid_api_key" and why in info.value.body["message"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "logprobs": 3}  # bad too: 401 comes first
        for headers, why in (({}, "missing bearer token"), ({"authorization": f"Basic {TOKEN}"}, "Bearer")):
            r = http.post(url + "/completions", json=body, headers=headers)
            assert r.status_code == 401 and why in r.json()["error"]["message"], r.text
        assert http.get(url + "/models").status_code == 401
        assert http.get(secure.http_url + "/health").status_code == 200          # probes carry no token
        assert http.get(url + "/models", headers={"authorization": "Bearer other-token"}).status_code == 200
    no_client_cert = ssl.create_default_context(cafile=pki.ca)
    with httpx2.Client(verify=no_client_cert, timeout=30) as http, pytest.raises(httpx2.TransportError):
        http.get(secure.http_url + "/health")
    with httpx2.Client(verify=False, timeout=30) as http, pytest.raises(httpx2.TransportError):
        http.get(secure.http_url.replace("https", "http") + "/health")


@pytest.mark.services
def test_health_over_tls_needs_no_token(secure):
    for service in ("", "specdec.v1.OrchestratorService", "specdec.v1.AdminService"):
        assert health(secure.channel, service) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.services
def test_oversized_message_is_resource_exhausted(secure):
    err = refused(lambda: stream(secure.channel, prompt="x" * (MAX_MESSAGE + 1)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert len(stream(secure.channel)[0]) == 24             # and it goes on serving


@pytest.mark.services
def test_cli_client_flags(secure, pki, capsys, monkeypatch):
    tls = ["--address", secure.orchestrator.address, "--tls-ca", pki.ca, "--tls-cert", pki.client_cert,
           "--tls-key", pki.client_key]
    assert cli.main(["generate", "def f(x):", "--max-new-tokens", "8", *tls, "--token", TOKEN]) == 0
    assert "completion_tokens=8" in capsys.readouterr().err
    assert cli.main(["generate", "def f(x):", *tls, "--token", "nope"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("SPECD_TOKEN", TOKEN)
    assert cli.main(["status", *tls]) == 0
    assert "verifiers: 1 serving" in capsys.readouterr().out
    assert cli.main(["status", *tls[:-2], "--tls-key", "/nonexistent/client.key"]) == 2
    assert "/nonexistent/client.key" in capsys.readouterr().err


@pytest.mark.unit
def test_bad_tls_files_are_named(pki, tmp_path):
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    cases = [(TlsConfig(cert="/no/such.pem", key=pki.server_key), "/no/such.pem"),
             (TlsConfig(cert=str(not_pem), key=pki.server_key), "not a PEM file"),
             (TlsConfig(cert=pki.server_cert, key=pki.server_key, require_client_cert=True), "--tls-ca"),
             (TlsConfig(cert=pki.server_cert), "--tls-key")]
    for tls, why in cases:
        with pytest.raises(SecurityConfigError, match=why):
            tls.check(server=True)
    TlsConfig(cert=pki.server_cert, key=pki.server_key, ca=pki.ca, require_client_cert=True).check(server=True)


@pytest.mark.unit
def test_token_file_and_compare(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("\n# none yet\n")
    with pytest.raises(SecurityConfigError, match="holds no token"):
        load_tokens(str(f))
    with pytest.raises(SecurityConfigError, match="no such file"):
        load_tokens(str(tmp_path / "missing"))
    assert load_tokens(None, "a, b,,") == ("a", "b")
    assert check_metadata((("authorization", "Bearer b"),), ("a", "b")) is None
    assert check_metadata((("authorization", "Bearer c"),), ("a", "b")) == "invalid bearer token"
    assert check_metadata((("x-other", "Bearer a"),), ("a",)).startswith("missing")


@pytest.mark.services
def test_sigterm_drains(plain, pairs):
    """SIGTERM: health NOT_SERVING and new requests UNAVAILABLE at once, while a
    running stream is served to its end; then the process exits cleanly. The
    verifier is paused (SIGSTOP) so the stream is still running when SIGTERM
    lands, whatever the machine's speed."""
    target, _ = pairs["llama"]
    orch = ServiceProcess("orchestrator", "--target", target, "--verifier-address", plain.verifier.address,
                          "--method", "off", "--shutdown-grace", "120", "--http-port", "-1")
    channel = grpc.insecure_channel(orch.address)
    result = {}
    completions = orch.http_url + "/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}

    def run():
        try:
            result["tokens"], result["chunks"] = stream(channel, token=None)
        except grpc.RpcError as exc:   # reported by the assertion below
            result["error"] = exc

    def run_http():  # an SSE stream over the HTTP API, running when SIGTERM lands too
        with httpx2.stream("POST", completions, json={**body, "stream": True}, timeout=120) as r:
            result["http"] = [line for line in r.iter_lines() if line]

    os.kill(plain.verifier.proc.pid, signal.SIGSTOP)
    try:
        runners = [threading.Thread(target=run), threading.Thread(target=run_http)]
        for runner in runners:
            runner.start()
        admin = pb_grpc.AdminServiceStub(channel)
        deadline = time.monotonic() + 60
        while admin.Status(pb.StatusRequest(), timeout=30).active_requests < 2:
            assert time.monotonic() < deadline, "the requests never reached the orchestrator"
            time.sleep(0.05)
        orch.proc.send_signal(signal.SIGTERM)
        while health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            time.sleep(0.05)
        err = refused(lambda: stream(channel, token=None))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details(), err
        assert httpx2.get(orch.http_url + "/health", timeout=30).status_code == 503
        r = httpx2.post(completions, json=body, timeout=30)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        assert orch.proc.poll() is None                 # still serving the running streams
    finally:
        os.kill(plain.verifier.proc.pid, signal.SIGCONT)
    try:
        for runner in runners:
            runner.join(60)
        assert "error" not in result, result.get("error")
        assert len(result["tokens"]) == 24 and result["chunks"][-1].finish_reason == "length"
        assert result["http"][-1] == "data: [DONE]" and '"finish_reason": "length"' in result["http"][-2]
        assert orch.proc.wait(60) == 0
    finally:
        channel.close()
        orch.stop()

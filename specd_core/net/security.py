"""TLS (and mutual TLS) for every gRPC link, configured by certificate paths.

One `TlsConfig` describes one side of every link a process has: a server
presents `cert`/`key` and, with `require_client_cert`, accepts only clients whose
certificate `ca` signed (mTLS); a client verifies the server against `ca` (the
system roots when None) and presents `cert`/`key` when it has them. The
orchestrator uses the same config for its public server and for its channels to
the replicas, so one certificate signed for both uses (serverAuth + clientAuth)
covers a deployment.

Files are read when credentials are built, i.e. at startup: a missing or
unreadable file fails the process before it serves, with the path named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class SecurityConfigError(ValueError):
    """A TLS or token setting is unusable (missing file, key without cert, ...)."""


@dataclass(frozen=True)
class TlsConfig:
    cert: str | None = None  # PEM certificate (chain) this side presents
    key: str | None = None  # PEM private key of `cert`
    ca: str | None = None  # PEM CA bundle: verifies the peer (clients: None = system roots)
    require_client_cert: bool = False  # servers: mTLS, refuse clients without a cert signed by `ca`
    # Clients: the name the server's certificate must carry, instead of the host
    # dialled. Replicas are dialled by Ray node IP, which a certificate rarely
    # lists; one name (e.g. `specd-internal`) then covers every node.
    server_name: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise SecurityConfigError("a TLS server needs both a certificate (--tls-cert) and its key (--tls-key)")
        if self.require_client_cert and not self.ca:
            raise SecurityConfigError(
                "mutual TLS (--tls-client-auth) needs the CA that signs client certificates (--tls-ca)"
            )
        return grpc.ssl_server_credentials(
            [(read_pem(self.key, "TLS key"), read_pem(self.cert, "TLS certificate"))],
            root_certificates=read_pem(self.ca, "TLS CA") if self.ca else None,
            require_client_auth=self.require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise SecurityConfigError("a client certificate (--tls-cert) and its key (--tls-key) go together")
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "TLS CA") if self.ca else None,
            private_key=read_pem(self.key, "TLS key") if self.key else None,
            certificate_chain=read_pem(self.cert, "TLS certificate") if self.cert else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def check(self, server: bool) -> None:
        """Fail now (naming the file) if the credentials cannot be built."""
        self.server_credentials() if server else self.channel_credentials()


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file; errors name the file and what it was for."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise SecurityConfigError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise SecurityConfigError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data:
        raise SecurityConfigError(f"{what} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def tls_from_args(args) -> TlsConfig | None:
    """--tls-cert/--tls-key/--tls-ca/--tls-client-auth/--tls-server-name -> TlsConfig,
    or None when none is given (plaintext)."""
    fields = {
        "cert": args.tls_cert,
        "key": args.tls_key,
        "ca": args.tls_ca,
        "require_client_cert": bool(getattr(args, "tls_client_auth", False)),
        "server_name": args.tls_server_name,
    }
    if not any(fields.values()):
        return None
    # Paths as absolute: a process started elsewhere (a Ray actor) reads them.
    for name in ("cert", "key", "ca"):
        if fields[name]:
            fields[name] = str(Path(fields[name]).expanduser().resolve())
    return TlsConfig(**fields)


def add_tls_flags(parser, server: bool) -> None:
    """The TLS flags; server=True adds --tls-client-auth (mTLS)."""
    g = parser.add_argument_group("TLS (every gRPC link; plaintext when no flag is given)")
    if server:
        g.add_argument(
            "--tls-cert",
            help="PEM certificate this server presents (and, dialling the replicas, its client certificate)",
        )
        g.add_argument("--tls-key", help="PEM private key of --tls-cert")
        g.add_argument(
            "--tls-ca",
            help="PEM CA bundle that verifies peers (client certificates with "
            "--tls-client-auth; the replicas' certificates)",
        )
        g.add_argument(
            "--tls-client-auth",
            action="store_true",
            help="mutual TLS: refuse clients without a certificate signed by --tls-ca",
        )
    else:
        g.add_argument(
            "--tls-ca",
            help="PEM CA bundle that verifies the server (default: system roots when another --tls-* flag is given)",
        )
        g.add_argument("--tls-cert", help="PEM client certificate (servers with mutual TLS)")
        g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--tls-server-name", help="name expected in the server's certificate instead of the host dialled")

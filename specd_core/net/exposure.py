"""Who can reach the public API: loopback is private to the machine; any other
address needs credentials (bearer tokens, or mutual TLS) unless the operator
says `--insecure`, because whoever reaches an open Generate or HTTP API can
generate on the deployment's hardware."""

from __future__ import annotations

import ipaddress

from specd_core.net.security import SecurityConfigError, TlsConfig

# Flags that give the public API credentials, named in the refusal.
CREDENTIAL_FLAGS = (
    "--auth-tokens-file FILE (or SPECD_AUTH_TOKENS), or mutual TLS (--tls-cert, --tls-key, --tls-ca, --tls-client-auth)"
)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def check_exposure(
    host: str, tls: TlsConfig | None, has_tokens: bool, insecure: bool, what: str = "Generate and the HTTP API"
) -> str | None:
    """Refuse (SecurityConfigError) to serve `what` beyond loopback without
    credentials; with `insecure`, the warning to print instead. None: nothing
    to say (loopback, or credentials required)."""
    if is_loopback(host) or has_tokens or (tls is not None and tls.require_client_cert):
        return None
    exposed = f"{what} on {host} without authentication: anyone who can reach this address can generate"
    if insecure:
        return f"warning: --insecure: serving {exposed}"
    raise SecurityConfigError(
        f"refusing to serve {exposed}; give {CREDENTIAL_FLAGS}, or --insecure to serve it unauthenticated anyway"
    )

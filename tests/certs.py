"""A throwaway PKI for the TLS tests: one CA, a server certificate (also usable
as a client certificate: the orchestrator presents it to the replicas under
mTLS) and a client certificate, written as PEM files."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def _issue(subject: str, key, issuer: x509.Name, issuer_key, *, ca: bool, usages=(), sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("specd test CA", ca_key, _name("specd test CA"), ca_key, ca=True)
    out = {"ca": directory / "ca.pem"}
    out["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for role, usages in (("server", (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)),
                         ("client", (ExtendedKeyUsageOID.CLIENT_AUTH,))):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"specd test {role}", key, ca_cert.subject, ca_key, ca=False, usages=usages,
                      sans=sans if role == "server" else ())
        (directory / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{role}_cert"] = directory / f"{role}.pem"
        out[f"{role}_key"] = Path(_write_key(key, directory / f"{role}.key"))
    return Pki(**{k: str(v) for k, v in out.items()})

"""Throwaway certificate authorities and the certificates they sign, made with the openssl binary
(tests that use them declare `needs_tool("openssl")`). Keys are RSA 2048, valid for a day."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

LOOPBACK_SANS = ("DNS:localhost", "IP:127.0.0.1")


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path

    def pem(self) -> tuple[bytes, bytes]:
        """(certificate, private key) as PEM bytes, the way grpc's credentials take them."""
        return self.cert.read_bytes(), self.key.read_bytes()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str, subject: str = "/CN=loraplex-test-ca") -> Issued:
    """A self-signed CA in `d` as NAME.pem / NAME.key. Two CAs may share a subject: a client must
    be checked against the CA's key, never its name."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-subj", subject, "-days", "1", cwd=d)
    return Issued(d / f"{name}.pem", d / f"{name}.key")


def issue(d: Path, ca: Issued, name: str, sans: tuple[str, ...] = LOOPBACK_SANS, cn: str | None = None) -> Issued:
    """A certificate for NAME signed by `ca`, with subjectAltNames `sans` (server and client use)."""
    (d / f"{name}.ext").write_text(f"subjectAltName={','.join(sans)}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={cn or name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return Issued(d / f"{name}.pem", d / f"{name}.key")

"""A throwaway certificate authority for TLS tests and benchmarks, made with the `openssl` CLI.

`make_certs(directory)` writes a CA (`ca.pem`) and a server certificate it signed for
127.0.0.1 and localhost (`server.pem`, `server.key`): a judge serving the latter is trusted by
a client given the former as `ca_file` (or SSL_CERT_FILE), and refused by any other.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA's certificate: what a client trusts
    cert: Path  # the server's certificate, signed by the CA
    key: Path  # the server's private key


def make_certs(directory: Path) -> Certs:
    """A new CA and a server certificate for 127.0.0.1 in `directory` (1 day valid)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    certs = Certs(d / "ca.pem", d / "server.pem", d / "server.key")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "basicConstraints=CA:FALSE\n")
    for args in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=qrq test CA", "-keyout", d / "ca.key", "-out", certs.ca],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", certs.key, "-out", d / "server.csr"],
        ["x509", "-req", "-in", d / "server.csr", "-CA", certs.ca, "-CAkey", d / "ca.key",
         "-CAcreateserial", "-days", "1", "-extfile", d / "san.ext", "-out", certs.cert],
    ):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
    return certs

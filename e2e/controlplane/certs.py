"""The PKI of a control plane, made with openssl in its pki/ dir: a CA and the API server's
serving certificate, the front proxy's CA and client certificate, the service-account signing
key, and the static token file of the admin user; on request, serving certificates of other
components (Kueue's webhook server) signed by the same CA."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .errors import ControlPlaneError

ADMIN_USER = "rlhf-e2e-admin"
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(pki: Path, *args: str) -> None:
    proc = subprocess.run(["openssl", *args], cwd=pki, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed:\n{proc.stdout}")


def write_admin_token(pki: Path, token: str) -> None:
    """tokens.csv (--token-auth-file): the admin's bearer token, in group system:masters."""
    (pki / "tokens.csv").write_text(f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')


def make_serving_cert(pki: Path, name: str, cn: str, sans: list[str]) -> None:
    """<name>.crt/.key in pki: a serving certificate for sans signed by the CA of make_pki."""
    _openssl(pki, "req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
    (pki / f"{name}.ext").write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
        f"subjectAltName={','.join(sans)}\n")
    _openssl(pki, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "3650", "-out", f"{name}.crt", "-extfile", f"{name}.ext")


def make_pki(pki: Path) -> None:
    """A CA, the API server's serving certificate, and the service-account signing key."""
    _openssl(pki, "req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=rlhf-e2e-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
             "-addext", "subjectKeyIdentifier=hash")
    make_serving_cert(pki, "apiserver", "kube-apiserver", [
        "IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost", "DNS:kubernetes",
        "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ])
    # Front proxy (aggregation layer): its own CA and the API server's client cert. Also
    # lets controller-manager and scheduler load a request-header CA instead of logging
    # its absence every second.
    _openssl(pki, "req", "-x509", *EC, "-keyout", "front-proxy-ca.key",
             "-out", "front-proxy-ca.crt", "-days", "3650",
             "-subj", "/CN=rlhf-e2e-front-proxy-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
             "-addext", "subjectKeyIdentifier=hash")
    _openssl(pki, "req", *EC, "-keyout", "front-proxy-client.key",
             "-out", "front-proxy-client.csr", "-subj", "/CN=front-proxy-client")
    (pki / "client.ext").write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n"
        "authorityKeyIdentifier=keyid,issuer\n")
    _openssl(pki, "x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt",
             "-CAkey", "front-proxy-ca.key", "-CAcreateserial", "-days", "3650",
             "-out", "front-proxy-client.crt", "-extfile", "client.ext")
    _openssl(pki, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-out", "sa.key")
    _openssl(pki, "pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")

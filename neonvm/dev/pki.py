"""A throwaway PKI for the local control plane: one CA, a serving cert, client certs.

The API server serves TLS and authenticates clients by certificate, as a real cluster
does; the admin certificate is in ``system:masters``. Every other identity (the
controller, the scheduler, ...) gets its own certificate so that RBAC and the admission
fence see distinct users.

The locks' etcd has a PKI of its own (another directory, another CA), so that no
certificate of the API server's CA is accepted there: its server certificate names the
real nodes' addresses too, and each client certificate's CN is an etcd user
(docs/local-cluster.md, "The locks' etcd").
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=365)
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/24"
"""The API server's ``--service-cluster-ip-range``."""
KUBERNETES_SERVICE_IP = "10.96.0.1"
"""The ClusterIP of ``default/kubernetes``: always the first address of that range."""


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name(attrs)


class LocalPKI:
    """Creates (once) and hands out certificates under ``directory``."""

    def __init__(self, directory: Path, ca_name: str = "neonvm-dev-ca") -> None:
        self.dir = directory
        self.ca_name = ca_name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca = CertPair(self.dir / "ca.crt", self.dir / "ca.key")
        if not self.ca.cert.exists():
            self._make_ca()

    def _make_ca(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(self.ca_name))
            .issuer_name(_name(self.ca_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        _write_key(self.ca.key, key)
        self.ca.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        name: str,
        common_name: str,
        orgs: tuple[str, ...] = (),
        server: bool = False,
        ips: Sequence[str] = (),
    ) -> CertPair:
        """A cert signed by the CA; server certs are valid for localhost, 127.0.0.1, the
        `kubernetes` Service's ClusterIP and ``ips``."""
        pair = CertPair(self.dir / f"{name}.crt", self.dir / f"{name}.key")
        if pair.cert.exists():
            return pair
        ca_key = serialization.load_pem_private_key(self.ca.key.read_bytes(), None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        ca_cert = x509.load_pem_x509_certificate(self.ca.cert.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, orgs))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        # The `kubernetes` Service's ClusterIP (the first of the API
                        # server's --service-cluster-ip-range): what a pod's in-cluster
                        # config connects to (a real node forwards it to 127.0.0.1).
                        x509.IPAddress(ipaddress.ip_address(KUBERNETES_SERVICE_IP)),
                        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips),
                    ]
                ),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        _write_key(pair.key, key)
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return pair

    def service_account_key(self) -> Path:
        """RSA key the API server signs service-account tokens with."""
        path = self.dir / "sa.key"
        if not path.exists():
            _write_key(path, rsa.generate_private_key(public_exponent=65537, key_size=2048))
        return path

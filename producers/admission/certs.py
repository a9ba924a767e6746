"""A self-signed CA and serving certificate for the webhook, when none is given (``cryptography``).

The API server calls webhooks over HTTPS only and verifies the certificate against the
webhook's ``caBundle``: the CA is printed (and optionally written) so that it can be put
there. Generated per start, so a restart changes the CA: in a cluster, give a certificate
(cert-manager, ``--tls-cert/--tls-key``) instead. Keys are EC P-256 (fast handshakes).
"""

from __future__ import annotations

import ipaddress
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _ip(value: str):
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None


def _ca(name: str, now: datetime, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    return ca, ca_key


def _leaf(ca: x509.Certificate, ca_key, common_name: str, sans: list[x509.GeneralName], usage, now: datetime, days: int):
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _write(directory: Path, name: str, cert: x509.Certificate, key) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.touch(mode=0o600)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


def self_signed(directory: Path, names: tuple[str, ...], hosts: tuple[str, ...] = ("127.0.0.1",), days: int = 365) -> tuple[Path, Path, bytes]:
    """Write ``ca.crt``, ``tls.crt``, ``tls.key`` under ``directory``; return (cert, key, CA PEM)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    ca, ca_key = _ca("gpuledger-admit-ca", now, days)
    sans: list[x509.GeneralName] = []
    for value in (*hosts, "127.0.0.1", *names):
        ip = _ip(value)
        entry = x509.IPAddress(ip) if ip else x509.DNSName(value)
        if value not in ("0.0.0.0", "::") and entry not in sans:
            sans.append(entry)
    cert, key = _leaf(ca, ca_key, names[0] if names else "gpuledger-admit", sans, ExtendedKeyUsageOID.SERVER_AUTH, now, days)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    (directory / "ca.crt").write_bytes(ca_pem)
    cert_path, key_path = _write(directory, "tls", cert, key)
    return cert_path, key_path, ca_pem


def client_certificates(directory: Path, common_name: str = "kube-apiserver-webhook-client", days: int = 365,
                        ca_name: str = "gpuledger-admit-client-ca") -> tuple[Path, Path, Path]:
    """A CA and one client certificate it signed, for the caller of ``/validate`` when the webhook
    authenticates it (``AdmitSettings.client_ca_file``): write ``client-ca.crt``, ``client.crt``,
    ``client.key`` under ``directory``; return (CA, certificate, key) paths. The API server
    presents the certificate from the kubeconfig of its AdmissionConfiguration (docs/admission.md);
    a cluster's own PKI (cert-manager) serves as well."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    ca, ca_key = _ca(ca_name, now, days)
    cert, key = _leaf(ca, ca_key, common_name, [], ExtendedKeyUsageOID.CLIENT_AUTH, now, days)
    ca_path = directory / "client-ca.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path, key_path = _write(directory, "client", cert, key)
    return ca_path, cert_path, key_path

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


def self_signed(directory: Path, names: tuple[str, ...], hosts: tuple[str, ...] = ("127.0.0.1",), days: int = 365) -> tuple[Path, Path, bytes]:
    """Write ``ca.crt``, ``tls.crt``, ``tls.key`` under ``directory``; return (cert, key, CA PEM)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuledger-admit-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for value in (*hosts, "127.0.0.1", *names):
        ip = _ip(value)
        entry = x509.IPAddress(ip) if ip else x509.DNSName(value)
        if value not in ("0.0.0.0", "::") and entry not in sans:
            sans.append(entry)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "gpuledger-admit")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    (directory / "ca.crt").write_bytes(ca_pem)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.touch(mode=0o600)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path, ca_pem

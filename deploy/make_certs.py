"""TLS material and SuperNode keys for a Flower fleet (and the coordinator), in one directory.

    python deploy/make_certs.py OUT --host superlink.example --host 10.0.0.5 --nodes 2

writes OUT/ca.crt + OUT/ca.key (a private CA), OUT/server.crt + OUT/server.key (signed by it,
valid for every --host as a DNS name or IP address, 127.0.0.1 and localhost always included)
and OUT/node{i}.key + OUT/node{i}.pub for i < --nodes: P-384 keys in OpenSSH format, the form
`flower-supernode --auth-supernode-private-key` and `flwr supernode register` read. Keys are
written 0600. For a real fleet use your own CA if you have one; this is the minimum that works.
Only `cryptography` is needed (installed with flwr).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def _write(path: Path, data: bytes, secret: bool) -> None:
    path.write_bytes(data)
    if secret:
        os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys([*hosts, *DEFAULT_HOSTS]):  # ordered, de-duplicated
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_ca_and_server(out: Path, hosts: list[str], days: int = 365) -> None:
    """OUT/ca.{crt,key} and OUT/server.{crt,key} for `hosts` (plus 127.0.0.1, localhost)."""
    now = dt.datetime.now(dt.UTC)
    # Backdated a little: a machine whose clock is slightly behind must still accept it.
    start, end = now - dt.timedelta(hours=1), now + dt.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "seedfed fleet CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0]
                                                        if hosts else DEFAULT_HOSTS[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(end).add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "ca.crt", ca.public_bytes(serialization.Encoding.PEM), secret=False)
    _write(out / "ca.key", _key_pem(ca_key), secret=True)
    _write(out / "server.crt", cert.public_bytes(serialization.Encoding.PEM), secret=False)
    _write(out / "server.key", _key_pem(key), secret=True)


def make_node_key(out: Path, name: str) -> tuple[Path, Path]:
    """OUT/NAME.key (OpenSSH private, 0600) and OUT/NAME.pub: a SuperNode's identity."""
    key = ec.generate_private_key(ec.SECP384R1())
    out.mkdir(parents=True, exist_ok=True)
    private, public = out / f"{name}.key", out / f"{name}.pub"
    _write(private, key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.OpenSSH,
                                      serialization.NoEncryption()), secret=True)
    _write(public, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                 serialization.PublicFormat.OpenSSH) + b"\n",
           secret=False)
    return private, public


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--host", action="append", default=[],
                        help="a DNS name or IP address the server certificate is valid for")
    parser.add_argument("--nodes", type=int, default=0, help="SuperNode key pairs to make")
    parser.add_argument("--days", type=int, default=365)
    args = parser.parse_args(argv)
    make_ca_and_server(args.out, args.host, days=args.days)
    for i in range(args.nodes):
        make_node_key(args.out, f"node{i}")
    print(f"wrote {args.out}/ca.crt, server.crt/.key and {args.nodes} SuperNode key pair(s)")


if __name__ == "__main__":
    main()

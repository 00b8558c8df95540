"""The deployment scripts that need no containers: deploy/make_certs.py (TLS material and
SuperNode keys in the formats Flower reads) and deploy/replay_check.py (record a log, replay
it to the same bits, and fail on a single differing bit)."""

from __future__ import annotations

import json
import ssl
import stat
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.fleet_helpers import make_tiny_bert
from tests.scripts_loader import load_script

make_certs = load_script("deploy/make_certs.py", "deploy_make_certs")
replay_check = load_script("deploy/replay_check.py", "deploy_replay_check")


def test_certificates_chain_to_the_ca_and_cover_the_hosts(tmp_path: Path) -> None:
    # Arrange / Act
    make_certs.main([str(tmp_path), "--host", "link.example", "--host", "10.1.2.3",
                     "--nodes", "2"])

    # Assert: a TLS server context accepts the pair; the SANs; keys private; node keys
    ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    ctx.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    cert = x509.load_pem_x509_certificate((tmp_path / "server.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"link.example", "localhost"}
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"10.1.2.3",
                                                                         "127.0.0.1"}
    for name in ("ca.key", "server.key", "node0.key", "node1.key"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    for i in range(2):
        private = serialization.load_ssh_private_key((tmp_path / f"node{i}.key").read_bytes(),
                                                     None)
        public = serialization.load_ssh_public_key((tmp_path / f"node{i}.pub").read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert isinstance(public, ec.EllipticCurvePublicKey)
        assert public.curve.name == "secp384r1"
        assert private.public_key().public_numbers() == public.public_numbers()


@pytest.mark.slow
def test_replay_check_matches_its_record_and_catches_one_flipped_bit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Arrange: a recorded log, and a copy with one coefficient one ulp away
    model = make_tiny_bert(tmp_path / "model")
    log = tmp_path / "log.json"
    assert replay_check.main(["record", "--model", str(model), "--out", str(log),
                              "--entries", "4", "--seeds", "3"]) == 0
    recorded = json.loads(capsys.readouterr().out)
    data = json.loads(log.read_text())
    c = np.float32(data["entries"][2]["coefs"][1])
    data["entries"][2]["coefs"][1] = float(np.nextafter(c, np.float32(1)))
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(data))

    # Act
    ok = replay_check.main(["verify", "--model", str(model), "--record", str(log)])
    verified = json.loads(capsys.readouterr().out)
    bad = replay_check.main(["verify", "--model", str(model), "--record", str(tampered)])
    refused = json.loads(capsys.readouterr().out)

    # Assert
    assert ok == 0 and verified["checksum"] == recorded["checksum"]
    assert verified["version"] == 4 and verified["matches_record"]
    assert bad == 1 and "ChecksumMismatchError" in refused["error"]
    assert "v3" in refused["error"]  # the first entry whose state differs

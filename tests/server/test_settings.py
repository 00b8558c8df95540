from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from seedfed.server.settings import Settings, load_settings


def test_production_refuses_a_missing_or_short_admin_token() -> None:
    with pytest.raises(ValidationError, match="admin_token is required in production"):
        Settings(production=True)
    with pytest.raises(ValidationError, match="at least 16 characters"):
        Settings(production=True, admin_token="short")


def test_development_generates_a_random_token_instead_of_a_default() -> None:
    a, b = Settings(), Settings()

    assert a.token != b.token and len(a.token) >= 16


def test_environment_then_toml_then_defaults(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "seedfed.toml"
    toml.write_text('database_url = "sqlite:///from-toml.db"\nport = 9000\n'
                    'max_body_bytes = 1234\n')
    monkeypatch.setenv("SEEDFED_PORT", "9100")

    s = load_settings(toml, admin_token="t" * 20)

    assert (s.database_url, s.port, s.max_body_bytes) == ("sqlite:///from-toml.db", 9100, 1234)
    assert s.host == "127.0.0.1"


def test_tls_needs_both_files() -> None:
    with pytest.raises(ValidationError, match="both tls_certfile and tls_keyfile"):
        Settings(tls_certfile=Path("cert.pem"))


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(ValidationError, match="databse_url"):
        Settings(databse_url="x")  # type: ignore[call-arg]

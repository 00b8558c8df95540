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


@pytest.mark.parametrize(("token", "msg"), [
    (" " * 16, "whitespace, control or other characters"),
    ("\t" * 40, "whitespace, control or other characters"),
    ("correct horse battery staple", "whitespace"),
    ("a" * 64, "too guessable"),
    ("admin-" + "y" * 24, "about 37 bits"),
    ("0123456789abcdef", "too guessable"),
])
def test_production_refuses_a_blank_or_guessable_admin_token_without_echoing_it(
        token: str, msg: str) -> None:
    with pytest.raises(ValidationError, match=msg) as caught:
        Settings(production=True, admin_token=token)

    assert token not in str(caught.value)  # the message names the problem, never the token
    assert "secrets.token_urlsafe" in str(caught.value)


def test_production_accepts_a_random_token() -> None:
    import secrets

    for token in (secrets.token_urlsafe(32), secrets.token_hex(16), secrets.token_urlsafe(16)):
        assert Settings(production=True, admin_token=token).token == token


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

"""deploy/seedfed.env.example: the settings file users copy for deploy/compose.yaml. A copy whose
secrets were never set cannot start: its admin token is a placeholder that the production
coordinator refuses with a one-line error saying how to make a real token, and its database
password is empty, which compose refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from seedfed.server import serve
from typer.testing import CliRunner

from seedfed.cli import app

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "seedfed.env.example"


def _example_values() -> dict[str, str]:
    lines = (ln.strip() for ln in EXAMPLE.read_text().splitlines())
    pairs = (ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))
    return {k: v for k, v in pairs}


def test_the_coordinator_refuses_the_example_admin_token_in_production(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: the example's token in the environment, production mode as in deploy/Dockerfile;
    # a coordinator that accepted it would fail here instead of serving
    def started(*_: object) -> None:
        raise AssertionError("the coordinator accepted the example's admin token")

    monkeypatch.setattr(serve, "serve", started)
    token = _example_values()["SEEDFED_ADMIN_TOKEN"]
    env = {"SEEDFED_ADMIN_TOKEN": token, "SEEDFED_PRODUCTION": "true",
           "SEEDFED_DATABASE_URL": f"sqlite:///{tmp_path}/c.db",
           "SEEDFED_STORE_DIR": str(tmp_path / "store")}

    # Act
    result = CliRunner().invoke(app, ["coordinator"], env=env)

    # Assert: a usage error on one line, naming the fix, never the token itself
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("error: ")
    assert "admin_token" in result.output and "SEEDFED_ADMIN_TOKEN" in result.output
    assert 'python -c "import secrets; print(secrets.token_urlsafe(32))"' in result.output
    assert token not in result.output



def test_compose_refuses_the_example_database_password() -> None:
    # Arrange
    compose = (EXAMPLE.parent / "compose.yaml").read_text()

    # Act
    password = _example_values()["POSTGRES_PASSWORD"]

    # Assert: empty, and compose stops on an empty or unset value with what to set
    assert password == ""
    assert "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}" in compose

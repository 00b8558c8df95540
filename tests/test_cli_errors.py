"""How commands fail (`seedfed.cli_errors`): one line per error with what to do, the right exit
status, a traceback only with --debug and never a local variable or a secret; and every option
of every command has help text."""

from __future__ import annotations

import errno
from collections.abc import Iterator

import click
import pytest
import typer
import typer.main
from pydantic import BaseModel, field_validator
from seedfed.shared.protocol.coordinator_client import CoordinatorHttpError
from seedfed.shared.protocol.errors import UserError
from seedfed.shared.protocol.redact import redact, remember
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.cli_errors import (
    FAILURE,
    USAGE,
    OptionError,
    ReportingGroup,
    describe,
    make_app,
    one_line,
)

SECRET = "s3cret-token-" + "q" * 20


def _walk(cmd: click.Command, path: tuple[str, ...]) -> Iterator[tuple[str, click.Command]]:
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _walk(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def _apps(t: typer.Typer) -> Iterator[typer.Typer]:
    yield t
    for group in t.registered_groups:
        assert group.typer_instance is not None
        yield from _apps(group.typer_instance)


def test_every_option_and_argument_of_every_command_has_help_text() -> None:
    root = typer.main.get_command(app)

    missing = [f"{path} {p.name}" for path, cmd in _walk(root, ("seedfed",))
               for p in cmd.params
               if p.name != "help" and not getattr(p, "hidden", False)
               and not (getattr(p, "help", None) or "").strip()]

    assert missing == []


def test_every_typer_app_reports_errors_itself_and_never_shows_locals() -> None:
    apps = list(_apps(app))

    assert len(apps) >= 5  # root, protocol, bench and the operator's groups
    for t in apps:
        assert t.info.cls is ReportingGroup
        assert t.pretty_exceptions_show_locals is False


# -- describe: the class of an exception decides message, hint and status ------------------------
class _Settings(BaseModel):
    admin_token: str

    @field_validator("admin_token")
    @classmethod
    def _long(cls, v: str) -> str:
        if len(v) < 64:
            raise ValueError("must have at least 64 characters")
        return v


@pytest.mark.parametrize("exc, needle, hint, code", [
    (UserError("no file at x.tsv (--data)", "give --data a file"), "no file at x.tsv",
     "give --data", FAILURE),
    (OptionError("--backend", "must be torch or ort"), "--backend: must be", "", USAGE),
    (CoordinatorHttpError(401, "GET", "/v1/tasks", "wrong admin token", "AuthenticationError",
                          "http://h:1"), "401 AuthenticationError: wrong admin token (http://h:1)",
     "--admin-token", FAILURE),
    (OSError(errno.EADDRINUSE, "Address already in use"), "address already in use", "--port",
     FAILURE),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "m/config.json"),
     "No such file or directory: m/config.json", "check the path", FAILURE),
    (ModuleNotFoundError("No module named 'onnx'", name="onnx"), "'onnx' is not installed",
     "pip install onnx", FAILURE),
    (ValueError("lr must be positive\nmore"), "lr must be positive", "--help", FAILURE),
    (KeyboardInterrupt(), "interrupted", "", 130),
    (ZeroDivisionError("division by zero"), "internal error: ZeroDivisionError", "--debug",
     FAILURE),
])
def test_each_class_of_error_has_its_message_hint_and_status(
        exc: BaseException, needle: str, hint: str, code: int) -> None:
    message, got_hint, got_code = describe(exc)

    assert needle in message and "\n" not in message
    assert hint in got_hint and got_code == code


def test_a_rejected_model_is_described_without_the_values_it_was_given() -> None:
    with pytest.raises(ValueError) as caught:
        _Settings(admin_token=SECRET)

    message, _, _ = describe(caught.value)

    assert "admin_token: must have at least 64 characters" in message
    assert SECRET not in message and SECRET not in one_line(message)


def test_one_line_masks_remembered_secrets_bearer_values_and_url_passwords() -> None:
    remember(SECRET)

    line = one_line(f"refused {SECRET} with Authorization: Bearer abc.def at "
                    "postgresql://u:hunter22@db/x", "try\nagain")

    assert line.startswith("error: ") and "\n" not in line
    assert SECRET not in line and "abc.def" not in line and "hunter22" not in line
    assert redact(SECRET) == "***"


# -- the group: every failure of a command is one line ------------------------------------------
def _demo(debug_env: bool = False) -> typer.Typer:
    demo = make_app()

    @demo.command("boom")
    def boom(token: str = typer.Option(..., "--token", help="a secret")) -> None:
        """Fail with a bug that holds a secret in a local variable."""
        secret_local = token  # noqa: F841 (a traceback with locals would print it)
        raise RuntimeError("the bug")

    @demo.command("other")
    def other() -> None:
        """A second command, so that `boom` is a subcommand."""

    return demo


def test_an_unexpected_error_is_one_line_and_exit_1_without_traceback() -> None:
    r = CliRunner().invoke(_demo(), ["boom", "--token", SECRET])

    assert r.exit_code == FAILURE
    assert r.stderr.strip().splitlines() == [
        "error: internal error: RuntimeError: the bug; rerun with --debug (or SEEDFED_DEBUG=1) "
        "for the traceback and report it"]
    assert "Traceback" not in r.output and SECRET not in r.output


def test_debug_adds_the_traceback_without_locals_or_secrets() -> None:
    remember(SECRET)

    r = CliRunner().invoke(_demo(), ["boom", "--token", SECRET], env={"SEEDFED_DEBUG": "1"})

    assert r.exit_code == FAILURE
    assert "Traceback" in r.stderr and "RuntimeError: the bug" in r.stderr
    assert "secret_local" not in r.stderr and "locals" not in r.stderr  # frames, no variables
    assert SECRET not in r.output
    assert r.stderr.strip().splitlines()[-1].startswith("error: internal error")


def test_a_usage_error_is_one_line_naming_the_option_and_exit_2() -> None:
    r = CliRunner().invoke(app, ["device", "--url", "http://127.0.0.1:9", "--task", "t"])

    assert r.exit_code == USAGE
    assert r.stderr.strip().splitlines() == [
        "error: Missing option '--data'; see 'seedfed device --help'"]


@pytest.mark.parametrize("group", ["protocol", "bench", "task", "round"])
def test_a_command_group_run_bare_shows_its_help_and_no_error(group: str) -> None:
    r = CliRunner().invoke(app, [group])

    assert r.exit_code == 0
    assert "Usage:" in r.stdout and "error" not in r.stderr


def test_the_root_debug_option_is_global() -> None:
    r = CliRunner().invoke(app, ["--debug", "protocol", "check", "--url", "ftp://nowhere"])

    assert r.exit_code == FAILURE
    assert "Traceback" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: cannot reach the coordinator")


def test_device_and_simulate_help_state_the_data_format() -> None:
    root = typer.main.get_command(app)
    assert isinstance(root, click.Group)

    for name in ("device", "simulate", "evaluate"):
        (data,) = [p for p in root.commands[name].params if p.name == "data"]
        text = data.help or ""  # type: ignore[attr-defined]
        assert "label<TAB>sentence" in text and "JSON Lines" in text and "0..K-1" in text
    device_data = [p for p in root.commands["device"].params if p.name == "data"][0]
    assert device_data.required and "label words" in (device_data.help or "")  # type: ignore

"""How every `seedfed` command fails: one line on stderr, never a traceback, never a secret.

    error: <what went wrong, naming the file, URL or option>; <what to do>

Every Typer app of the command line is made by `make_app`, whose group class runs the command
inside `report`: an exception of any kind becomes that one line (`describe` maps the project's
errors and the expected environment failures to a message and a hint) and a non-zero exit
status (2: the command line itself is wrong; 1: anything else; 130: interrupted). The global
`--debug` option (or SEEDFED_DEBUG=1) adds the traceback, without local variables. Every line
goes through `shared.redact`, so a token that slipped into an exception's text is masked.

The same module keeps third-party warnings out of normal output (`quiet_warnings`) and routes
log records through the redaction (`install_logging`).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import click
import typer
from typer.core import TyperArgument, TyperGroup

from seedfed.shared.protocol.coordinator_client import CoordinatorHttpError
from seedfed.shared.protocol.errors import UserError
from seedfed.shared.protocol.redact import redact, redact_url

DEBUG_ENV = "SEEDFED_DEBUG"
#: Exit status of a wrong command line (click's), of any other failure, of an interrupt.
USAGE, FAILURE, INTERRUPTED = 2, 1, 130
#: Longest message printed (a coordinator's detail can be a whole HTML page).
MAX_MESSAGE = 600

_debug = False


def set_debug(on: bool) -> None:
    global _debug
    _debug = on


def debug_enabled() -> bool:
    return _debug or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class UsageError(UserError):
    """The command line is wrong (exit status 2, as click's own usage errors)."""

    exit_code = USAGE


class OptionError(UsageError):
    """An option's value is wrong: names the option."""

    def __init__(self, option: str, what: str, hint: str = "") -> None:
        super().__init__(f"{option}: {what}", hint)
        self.option = option


# -- exception -> (message, hint, exit status) ---------------------------------------------------
def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0].strip() if text else type(e).__name__


def _refusal(e: CoordinatorHttpError) -> tuple[str, str]:
    said = f"{e.status} {e.error or 'error'}: {e.detail}"
    where = f" ({e.url})" if e.url else ""
    hints = {401: "check the token: an operator command takes --admin-token (or "
                  "SEEDFED_ADMIN_TOKEN), a device its join token",
             403: "this token may not do that: operator commands need the admin token",
             404: "check the task id (`seedfed task list`) and --url",
             409: "the task moved on meanwhile: look at `seedfed task show TASK` and retry"}
    hint = hints.get(e.status, "see the coordinator's log" if e.status >= 500 else
                     "check the command's options")
    return f"{said}{where}", hint


def _validation_error(e: Any) -> tuple[str, str]:
    """A pydantic ValidationError as `field: reason` pairs, never the input it was given (a
    settings dump holds the admin token). Settings are the user's; any other model is an
    answer on the wire that did not follow the protocol."""
    parts = []
    for err in e.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err.get("loc", ())) or e.title
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    hint = ("see the command's --help" if e.title == "Settings" else "check that --url is a "
            "seedfed coordinator of this version")
    return f"invalid {e.title}: " + "; ".join(parts), hint


def _transport_error(e: Any) -> tuple[str, str]:
    """An httpx transport error outside the coordinator client: its URL, never its headers."""
    try:
        url = redact_url(str(e.request.url))
    except RuntimeError:  # raised before a request was made
        url = "the coordinator"
    return f"cannot reach {url} ({_first_line(e)})", "check that it is running and --url"


def _os_error(e: OSError) -> tuple[str, str]:
    if e.errno == errno.EADDRINUSE:
        return f"address already in use ({e.strerror})", "stop the other process or choose " \
                                                          "another --port"
    path = e.filename if e.filename is not None else ""
    what = f"{e.strerror or _first_line(e)}: {path}" if path else _first_line(e)
    if isinstance(e, FileNotFoundError):
        return what, "check the path"
    if isinstance(e, PermissionError):
        return what, "check the file's permissions, or choose another path"
    return what, "check the path and the disk"


def describe(e: BaseException) -> tuple[str, str, int]:
    """(message, hint, exit status) of an exception a command raised."""
    if isinstance(e, UserError):
        return e.what, e.hint, int(getattr(e, "exit_code", FAILURE))
    if isinstance(e, click.ClickException):
        return e.format_message().rstrip("."), "", e.exit_code
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", "", INTERRUPTED
    if isinstance(e, CoordinatorHttpError):
        return (*_refusal(e), FAILURE)
    for check, render in _LIBRARY_ERRORS:
        if check(e):
            return (*render(e), FAILURE)
    if isinstance(e, OSError):
        return (*_os_error(e), FAILURE)
    if isinstance(e, KeyError):  # a file or an answer that lacks an entry
        return f"missing entry {e.args[0]!r}" if e.args else "missing entry", \
            "check the file or --url given", FAILURE
    if isinstance(e, ValueError | LookupError):  # the project's own checks (messages name it)
        return _first_line(e), "see the command's --help", FAILURE
    return (f"internal error: {type(e).__name__}: {_first_line(e)}",
            f"rerun with --debug (or {DEBUG_ENV}=1) for the traceback and report it", FAILURE)


def _is(module: str, name: str) -> Callable[[BaseException], bool]:
    """An isinstance check against a library's class, without importing the library."""
    def check(e: BaseException) -> bool:
        lib = sys.modules.get(module)
        cls = getattr(lib, name, None) if lib is not None else None
        return isinstance(cls, type) and isinstance(e, cls)
    return check


def _missing_module(e: BaseException) -> tuple[str, str]:
    name = getattr(e, "name", None) or _first_line(e)
    return f"the Python package {name!r} is not installed", \
        f"install it (pip install {name.split('.')[0]}) or the seedfed extra that needs it"


_LIBRARY_ERRORS: tuple[tuple[Callable[[BaseException], bool],
                             Callable[[Any], tuple[str, str]]], ...] = (
    (_is("pydantic_core", "ValidationError"), _validation_error),
    (_is("httpx", "TransportError"), _transport_error),
    (_is("sqlalchemy.exc", "SQLAlchemyError"), lambda e: (
        f"database error: {_first_line(e)}", "check the database URL (--db, or "
        "SEEDFED_DATABASE_URL): e.g. sqlite:///seedfed.db or postgresql+psycopg://user@host/db")),
    (lambda e: isinstance(e, ModuleNotFoundError), _missing_module),
    (_is("safetensors", "SafetensorError"), lambda e: (
        f"not a readable safetensors file: {_first_line(e)}", "check the file given")),
)


# -- printing ------------------------------------------------------------------------------------
def one_line(message: str, hint: str = "") -> str:
    """`error: message; hint` as one line, redacted and cut to MAX_MESSAGE."""
    text = " ".join(message.split())
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + "..."
    hint = " ".join(hint.split())
    return redact(f"error: {text}; {hint}" if hint else f"error: {text}")


def report(e: BaseException, command: str = "seedfed") -> int:
    """Print `e` as one line on stderr (after its traceback when debugging); its exit status."""
    message, hint, code = describe(e)
    if code == USAGE:
        hint = hint or f"see '{command} --help'"
    hint = hint.replace("the command's --help", f"'{command} --help'")
    if debug_enabled() and not isinstance(e, click.ClickException | KeyboardInterrupt):
        tb = "".join(traceback.format_exception(e))  # no locals: frames and messages only
        sys.stderr.write(redact(tb))
    typer.echo(one_line(message, hint), err=True)
    return code


def _command_path(group: click.Group, prog: str, args: Sequence[str]) -> str:
    """`seedfed device` for args `["--debug", "device", "--url", ...]`: for hints."""
    path: list[str] = [prog]
    cmd: click.Command = group
    for a in args:
        if a.startswith("-"):
            continue
        sub = cmd.commands.get(a) if isinstance(cmd, click.Group) else None
        if sub is None:
            break
        path.append(a)
        cmd = sub
    return " ".join(path)


class ReportingGroup(TyperGroup):
    """A Typer group whose `main` reports every failure as one line (`report`)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        prog = prog_name or self.name or "seedfed"
        set_debug("--debug" in argv)  # known before parsing (the root option sets it too)
        try:
            with warnings.catch_warnings():
                quiet_warnings()
                install_logging()
                rv = super().main(args=argv, prog_name=prog, complete_var=complete_var,
                                  standalone_mode=False,
                                  windows_expand_args=windows_expand_args, **extra)
            code = rv if isinstance(rv, int) else 0  # an Exit's status, else success
        except click.exceptions.Exit as e:
            code = e.exit_code
        except click.exceptions.NoArgsIsHelpError:  # a group run bare: its help is the answer
            code = 0
        except click.Abort:
            typer.echo(one_line("aborted"), err=True)
            code = FAILURE
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 (the one place they end)
            code = report(e, _command_path(self, prog, argv))
        if standalone_mode:
            sys.exit(code)
        return code


def _keep_argument_help() -> None:
    """Typer (0.20) sets a TyperArgument's `help` before calling click's Parameter.__init__,
    which (click 8.3 and later) sets it again from its own `help` argument, None: every
    argument's help text is lost. Set it once more afterwards (idempotent; a no-op where the
    two agree)."""
    init = TyperArgument.__init__
    if getattr(init, "_keeps_help", False):
        return

    @functools.wraps(init)
    def keep(self: TyperArgument, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.help is None and kwargs.get("help"):
            self.help = kwargs["help"]

    keep._keeps_help = True  # type: ignore[attr-defined]
    TyperArgument.__init__ = keep  # type: ignore[method-assign]


_keep_argument_help()


def make_app(**kwargs: Any) -> typer.Typer:
    """A Typer app of the command line: failures reported as one line, no locals shown."""
    return typer.Typer(cls=ReportingGroup, pretty_exceptions_enable=False,
                       pretty_exceptions_show_locals=False, **kwargs)


# -- warnings and logs ---------------------------------------------------------------------------
def quiet_warnings() -> None:
    """Hide warnings raised in third-party code (a Ray FutureWarning, a torch deprecation)
    from normal output; seedfed's own stay. --debug keeps them all."""
    if debug_enabled():
        return
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"seedfed(\.|$)")


class RedactingFilter(logging.Filter):
    """Masks secrets (`shared.redact`) in a record's final message; a logged traceback only
    with --debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not debug_enabled():
            record.exc_info, record.exc_text = None, None
        return True


class _StderrHandler(logging.Handler):
    """`warning: message` on the current sys.stderr (looked up per record: a test runner
    swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"{record.levelname.lower()}: {self.format(record)}\n")
        except Exception:  # noqa: BLE001 (logging must never raise)
            self.handleError(record)


def install_logging() -> None:
    """Warnings and errors of seedfed's loggers (`seedfed.*`) as `warning: ...` lines on
    stderr, redacted; idempotent."""
    logger = logging.getLogger("seedfed")
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler(logging.WARNING)
    handler.addFilter(RedactingFilter())
    logger.addHandler(handler)

"""The operator's commands: create and inspect tasks, open and close rounds, revoke devices.

    seedfed task create --recipe sst2 --set quorum=5      # prints the task id and join token
    seedfed task list | show ID
    seedfed round open ID | close ID [--round N] | abandon ID [N] --reason TEXT
    seedfed round schedule ID --auto|--manual [--rounds N | --no-limit]
    seedfed devices list ID | revoke ID DEVICE

Every command talks to a running coordinator (`--url`, or SEEDFED_URL) with the admin token
(`--admin-token`, or SEEDFED_ADMIN_TOKEN), through `shared/admin_client.AdminClient`; tables
by default, `--json` for scripts. A refusal is one line, the coordinator's status, error type
and reason, the URL and what to do (`seedfed.cli_errors`), and exits 1. `build_spec` (a pure
function) turns the create options into the TaskSpec the coordinator validates again on its
side. Everything beyond the base, the scope, the format and the labels is a `--set key=value`
(a TaskSpec field, a scope option or a `CreateSettings` field). A task created from a recipe
is named after it unless `--name` is given, and scopes show as what they are (`head` for the
recipes' classifier head, `scope_label`).
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from seedfed.admin_client import AdminClient
from seedfed.cli_errors import OptionError, UsageError, make_app
from seedfed.shared.protocol.coordinator_client import CoordinatorHttpError
from seedfed.shared.protocol.errors import UserError
from seedfed.shared.protocol.messages import Routes, TaskStatus
from seedfed.shared.protocol.recipes import (
    HEAD,
    RECIPES,
    SCOPES,
    lm_counterpart,
    parse_set,
    recipe,
    resolve_recipe,
)
from seedfed.shared.protocol.redact import remember
from seedfed.shared.protocol.task import TaskSpec

ADMIN_TOKEN_ENV = "SEEDFED_ADMIN_TOKEN"
URL_ENV = "SEEDFED_URL"

#: How a command reaches the coordinator: (base URL) -> an httpx client. Tests replace it
#: with an in-process app's client.
HttpFactory = Callable[[str], httpx.Client]


def _default_http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url.rstrip("/"), timeout=120.0)


http_factory: HttpFactory = _default_http

task_app = make_app(no_args_is_help=True, help="Create and inspect tasks (admin).")
round_app = make_app(no_args_is_help=True, help="Open, close and abandon rounds, and say who "
                     "opens them (admin).")
devices_app = make_app(no_args_is_help=True, help="List and revoke devices (admin).")

URL = typer.Option("http://127.0.0.1:8080", "--url", envvar=URL_ENV,
                   help=f"coordinator base URL (or {URL_ENV})")
ADMIN_TOKEN = typer.Option(None, "--admin-token", envvar=ADMIN_TOKEN_ENV, show_default=False,
                           help=f"the coordinator's admin token (or {ADMIN_TOKEN_ENV})")
TASK_ID = typer.Argument(..., help="the task's id (`seedfed task list`)")
AS_JSON = typer.Option(False, "--json", help="print JSON instead of a table")
SETS = typer.Option([], "--set", help=(
    "key=value (repeat): a TaskSpec field (lr, eps, steps, perturbations, batch_size, "
    "decay_rounds, lr_final_ratio, clip, one_sided, rule, clip_bound, trim, max_num_examples, "
    "max_seq_len, ...), an option of the scope (patterns, ...), or quorum, round_timeout_s, "
    "devices_per_round; a key two sections share is qualified (lora.alpha)"))
LABELS = typer.Option([], "--label", help="label description (repeat, in label order)")


# -- the task definition -------------------------------------------------------------------------
#: The `--set` section of a task's coordinator settings (`task.quorum`, or `quorum`).
SETTINGS = "task"


@dataclass(frozen=True)
class CreateSettings:
    """How the coordinator runs a created task's rounds (`--set`, beside the TaskSpec's keys)."""

    quorum: int = field(default=1, metadata={"help": "uploads that close a round"})
    round_timeout_s: float = field(default=600.0, metadata={
        "help": "seconds a round stays open waiting for its quorum"})
    devices_per_round: int | None = field(default=None, metadata={
        "help": "devices sampled per round (None: every device that asks)"})

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {self.quorum}")
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s must be positive, got {self.round_timeout_s}")
        if self.devices_per_round is not None and self.devices_per_round < 1:
            raise ValueError(f"devices_per_round must be >= 1, got {self.devices_per_round}")


@dataclass(frozen=True)
class CreateOptions:
    """What `task create` takes: the base (a recipe, TaskSpec's defaults on --model, or a
    --spec file), the scope, the format, the labels and the `--set` items."""

    recipe: str | None = "sst2"
    model: str | None = None
    spec_file: Path | None = None
    scope: str | None = None
    fmt: str | None = None
    label_texts: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.recipe is not None:
            recipe(self.recipe)  # ValueError listing the recipes
        if self.recipe is None and self.model is None and self.spec_file is None:
            raise ValueError("give --recipe, --model or --spec")


def build_spec(o: CreateOptions) -> tuple[TaskSpec, CreateSettings]:
    """The TaskSpec of `task create` and its coordinator settings: the base (a TaskSpec JSON
    file, a recipe, or TaskSpec's defaults on `--model`, the `bare` recipe), then the scope
    and each `--set` (`seedfed.shared.protocol.recipes.resolve_recipe`: a scope other than the
    base's starts from TaskSpec's conservative lr and eps, as `simulate`)."""
    base = (TaskSpec.from_dict(json.loads(o.spec_file.read_text("utf-8")))
            if o.spec_file is not None else None)
    name = o.recipe or "bare"
    # on a causal LM a classifier recipe is its LM counterpart (`recipes.lm_counterpart`)
    kind = o.scope or (base.scope if base is not None else
                       recipe(lm_counterpart(name, o.model)).scope)
    given = parse_set(o.sets, kind, settings=(SETTINGS, CreateSettings))
    if o.fmt is not None:
        given["spec.format"] = o.fmt
    if o.label_texts:
        given["spec.label_texts"] = o.label_texts
    spec = resolve_recipe(name, given, model=o.model, scope=o.scope, base=base).spec
    own = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith(SETTINGS + ".")}
    return spec, CreateSettings(**own)


# -- plumbing ------------------------------------------------------------------------------------
#: What an operator does about a refusal, by status.
REFUSAL_HINTS = {
    401: f"check --admin-token (or {ADMIN_TOKEN_ENV}): it must be the coordinator's admin "
         "token",
    403: f"check --admin-token (or {ADMIN_TOKEN_ENV}): it must be the coordinator's admin "
         "token",
    404: "check the id (`seedfed task list`, `seedfed devices list TASK`) and --url",
    409: "the task's state does not allow it now: see `seedfed task show TASK`",
}


def refused(e: CoordinatorHttpError) -> UserError:
    """A coordinator's refusal of an operator command, as one line with what to do."""
    where = f" ({e.url})" if e.url else ""
    hint = REFUSAL_HINTS.get(e.status, "see the coordinator's log" if e.status >= 500
                             else "check the command's options (--help)")
    return UserError(f"{e.status} {e.error or 'error'}: {e.detail}{where}", hint)


@contextmanager
def admin(url: str, token: str | None = None) -> Iterator[AdminClient]:
    """The admin client of `url` with `token` (default: SEEDFED_ADMIN_TOKEN); a refusal
    becomes one line (`refused`) and exit status 1."""
    token = token or os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        raise OptionError("--admin-token", "no admin token given",
                          f"pass --admin-token or set {ADMIN_TOKEN_ENV}")
    remember(token)
    http = http_factory(url)
    try:
        yield AdminClient(http, token)
    except CoordinatorHttpError as e:
        raise refused(e) from None
    finally:
        http.close()


def printable(text: object) -> str:
    """`text` as a terminal shows it literally: each control, format or separator character
    (ANSI escapes, newlines, carriage returns, other C0/C1 characters, bidirectional overrides,
    zero-width characters: what the coordinator refuses in names, `server/schemas.py`) as its
    escape (`\\x1b`, `\\n`, `\\u202e`). Task names and abandon reasons stored by an older
    coordinator could otherwise rewrite what the operator sees; every table cell and title, and
    every message naming a task, goes through it (`--json` escapes them by itself)."""
    out = []
    for ch in str(text):
        category = unicodedata.category(ch)
        if category[0] == "C" or category in ("Zl", "Zp"):
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


def _emit(data: Any, as_json: bool, table: Callable[[], Table] | None = None) -> None:
    if as_json or table is None:
        typer.echo(json.dumps(data, default=str))
    else:
        Console(width=160).print(table())


def _cell(value: Any) -> Text:
    """A table cell: `printable`, and a Text so that rich reads no markup ([bold]) in it."""
    if isinstance(value, Text):  # built from printable parts (`_round_lines`)
        return value
    return Text("-" if value is None else f"{value:.4g}" if isinstance(value, float)
                else printable(value))


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=_cell(title))
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*(_cell(v) for v in r))
    return t


# -- task ----------------------------------------------------------------------------------------
@task_app.command("create")
def task_create(
    url: str = URL,
    recipe_name: str = typer.Option(None, "--recipe", help="start from a recipe (`seedfed "
                                    f"recipes`): {', '.join(RECIPES)} (default sst2 unless "
                                    "--model or --spec)"),
    sets: list[str] = SETS,
    model: str = typer.Option(None, "--model", help="Hugging Face model directory, as the "
                              "coordinator sees it"),
    spec_file: str = typer.Option(None, "--spec", help="a TaskSpec JSON file as the base"),
    name: str = typer.Option(None, "--name", help="the task's name (default: the recipe's)"),
    scope: str = typer.Option(None, "--scope", help="head (the classifier), lora, full, named,"
                              " scales, ternary"),
    fmt: str = typer.Option(None, "--format", help="fp32, fp16, bf16, int8, int4, ternary"),
    label: list[str] = LABELS,
    rounds: int = typer.Option(None, "--rounds", min=1, help="stop the automatic rounds once "
                               "the task reached version N (default: no limit)"),
    manual: bool = typer.Option(False, "--manual", help="open every round by hand (`seedfed "
                                "round open`) instead of the coordinator running them back to "
                                "back once a device enrolled"),
    as_json: bool = AS_JSON,
    admin_token: str = ADMIN_TOKEN,
) -> None:
    """Create a task; prints its id and the join token (shown once: give it to the devices).
    The coordinator then runs its rounds by itself (the first once a device enrolled, each
    next one as soon as the last ended) until --rounds, unless --manual."""
    if scope is not None and scope in RECIPES and scope not in SCOPES:
        raise OptionError("--scope", f"{scope!r} is a recipe, not a scope",
                          f"say --recipe {scope} (scopes: {', '.join(SCOPES)})")
    base = recipe_name or (None if model or spec_file else "sst2")
    try:
        spec, settings = build_spec(CreateOptions(
            recipe=base, model=model, spec_file=Path(spec_file) if spec_file else None,
            scope=scope, fmt=fmt, label_texts=tuple(label), sets=tuple(sets)))
    except (ValueError, TypeError, OSError) as e:
        if isinstance(e, UserError):
            raise
        raise UsageError(str(e), "see `seedfed task create --help` and `seedfed recipes`") from e
    with admin(url, admin_token) as api:
        # a task from a recipe is named after it: `task list` then says what it is
        created = api.create_task(spec.to_dict(), name=name or (None if spec_file else base),
                                  quorum=settings.quorum,
                                  round_timeout_s=settings.round_timeout_s,
                                  devices_per_round=settings.devices_per_round,
                                  schedule="manual" if manual else "auto", max_rounds=rounds)
    _emit(created, as_json, lambda: _table("task created", ("task", "join token", "version",
                                                           "checksum"),
                                          [(created["task_id"], created["join_token"],
                                            created["version"], created["checksum"][:16])]))


@task_app.command("list")
def task_list(url: str = URL, as_json: bool = AS_JSON, admin_token: str = ADMIN_TOKEN) -> None:
    """Every task: version, round, state, devices, scope."""
    with admin(url, admin_token) as api:
        tasks = api.list_tasks()
        scopes = {t.task_id: _scope_of(api, t.task_id, t.scope) for t in tasks}
    _emit([{**t.model_dump(mode="json"), "scope_label": scopes[t.task_id]} for t in tasks],
          as_json, lambda: _table(
        "tasks", ("task", "name", "version", "round", "state", "devices", "seen", "quorum",
                  "scope", "params", "format", "aggregation"),
        [(t.task_id, t.name, t.version, t.round, t.state, t.devices, t.devices_seen, t.quorum,
          scopes[t.task_id], t.scope_numel, t.format, t.aggregation) for t in tasks]))


def scope_label(spec: dict[str, Any]) -> str:
    """A task's scope as `task create --scope` names it: `head` for the recipes' classifier
    head (scope "named" on ["classifier"]), a named scope with its patterns, LoRA with its
    rank and targets, else the scope's name."""
    scope = str(spec.get("scope"))
    patterns = [str(p) for p in (spec.get("scope_options") or {}).get("patterns") or ()]
    if scope == "named":
        return HEAD if patterns == ["classifier"] else f"named ({', '.join(patterns)})"
    if scope == "lora":
        lora = spec.get("lora") or {}
        targets = ", ".join(str(t) for t in lora.get("target_modules") or ())
        head = " + head" if lora.get("train_head") else ""
        return f"lora r{lora.get('r')} ({targets}{head})"
    return scope


def _scope_of(api: AdminClient, task_id: str, fallback: str) -> str:
    try:
        return scope_label(api.spec(task_id))
    except CoordinatorHttpError:  # removed meanwhile: the status's own word
        return fallback


@task_app.command("show")
def task_show(task_id: str = TASK_ID, url: str = URL,
              last: int = typer.Option(20, "--last", min=1, help="rounds shown in the table"),
              as_json: bool = AS_JSON, admin_token: str = ADMIN_TOKEN) -> None:
    """One task: version, checksum, state, participation and loss per round."""
    with admin(url, admin_token) as api:
        status = api.status(task_id)
        rounds = api.round_metrics(task_id)
        scope = _scope_of(api, task_id, status.scope)
    data = {**status.model_dump(mode="json"), "scope_label": scope, "rounds": rounds}

    def tables() -> Table:
        t = _table(f"task {status.task_id} ({status.name})", ("field", "value"), [
            ("version", status.version), ("checksum", status.checksum[:16] + "..."),
            ("round", status.round), ("state", status.state),
            ("devices", f"{status.devices} enrolled, {status.devices_seen} seen"),
            ("quorum", status.quorum), ("scope", f"{scope} ({status.scope_numel} values)"),
            ("format", status.format), ("aggregation", status.aggregation),
            ("epsilon", status.epsilon), ("schedule", _schedule_line(status)),
            ("waiting for", status.waiting), ("close error", _close_line(status)),
            ("abandoned", None if status.abandoned_round is None else
             f"round {status.abandoned_round}: {status.abandon_reason}")])
        t.add_section()
        t.add_row(_cell("rounds"), _round_lines(rounds[-last:]))
        return t

    _emit(data, as_json, tables)


def _schedule_line(status: TaskStatus) -> str:
    """Who opens the task's rounds, and the automatic schedule's limit."""
    if status.schedule == "manual":
        return "by hand (seedfed round open)"
    limit = "" if status.max_rounds is None else f" until v{status.max_rounds}"
    return f"automatic, back to back{limit}"


def _close_line(status: TaskStatus) -> str | None:
    if status.close_error is None:
        return None
    if status.close_permanent:
        return f"{status.close_error} (fails on every attempt: not retried)"
    return f"{status.close_error} (attempt {status.close_attempts}, retried)"


def _round_lines(rounds: Sequence[dict[str, Any]]) -> Text:
    """One line per round (a cell of `task show`), the abandon reason through `printable`."""
    lines = ["round  state       base -> version  participants  loss"]
    for r in rounds:
        loss = "-" if r.get("loss") is None else f"{r['loss']:.4f}"
        version = "-" if r.get("version") is None else r["version"]
        why = f"  ({printable(r['abandon_reason'])})" if r.get("abandon_reason") else ""
        lines.append(f"{r['round']:>5}  {printable(r['state']):<10}  {r['base_version']:>4} -> "
                     f"{version!s:<7}  {r['participants']:>12}  {loss}{why}")
    return Text("\n".join(lines) if rounds else "no rounds yet")


# -- round ---------------------------------------------------------------------------------------
@round_app.command("open")
def round_open(task_id: str = TASK_ID, url: str = URL,
               as_json: bool = AS_JSON, admin_token: str = ADMIN_TOKEN) -> None:
    """Open the task's next round (or show the one already open). A task whose rounds ran
    automatically is opened by hand from then on (`seedfed round schedule ID --auto` hands it
    back)."""
    with admin(url, admin_token) as api:
        was = api.status(task_id).schedule
        plan = api.open_round(task_id)
    _emit(plan.model_dump(mode="json"), as_json, lambda: _table(
        f"round {plan.round} of {plan.task_id}", ("round", "version", "steps x P", "lr", "eps",
                                                  "batch", "quorum", "deadline"),
        [(plan.round, plan.version, f"{plan.steps} x {plan.perturbations}", plan.lr, plan.eps,
          plan.batch_size, plan.quorum, plan.deadline)]))
    if was == "auto" and not as_json:
        shown = printable(task_id)
        typer.echo(f"task {shown} now runs its rounds by hand; `seedfed round schedule "
                   f"{shown} --auto` hands them back to the coordinator", err=True)


@round_app.command("close")
def round_close(task_id: str = TASK_ID, url: str = URL,
                number: int = typer.Option(None, "--round", min=0,
                                           help="round number (default: the open one)"),
                as_json: bool = AS_JSON, admin_token: str = ADMIN_TOKEN) -> None:
    """Aggregate the round's uploads and commit the next version."""
    with admin(url, admin_token) as api:
        if number is None:
            plan = api.current_plan(task_id)
            if plan is None:
                raise UserError(f"task {task_id} has no open round",
                                f"open one with `seedfed round open {task_id}`")
            number = plan.round
        entry = api.close_round(task_id, number)
    _emit(entry.model_dump(mode="json"), as_json, lambda: _table(
        f"round {number} closed", ("task", "version", "seeds", "checksum"),
        [(entry.task_id, entry.base_version + 1, len(entry.seeds), entry.checksum[:16])]))


@round_app.command("abandon")
def round_abandon(task_id: str = TASK_ID,
                  number: int = typer.Argument(None, min=0, show_default=False,
                                               help="round number (default: the task's open "
                                               "or aggregating round)"),
                  reason: str = typer.Option(..., "--reason", help="why: kept with the round "
                                             "and shown by `task show` and the dashboard"),
                  url: str = URL, as_json: bool = AS_JSON,
                  admin_token: str = ADMIN_TOKEN) -> None:
    """End a round without a new version (e.g. one whose close fails on every attempt): its
    uploads are not aggregated and the task goes on from its committed version."""
    with admin(url, admin_token) as api:
        if number is None:
            status = api.status(task_id)
            if status.round is None or status.state == "idle":
                raise UserError(f"task {task_id} has no open or aggregating round",
                                "name the round: `seedfed round abandon TASK N --reason ...`")
            number = status.round
        out = api.abandon_round(task_id, number, reason)
    _emit(out, as_json, lambda: _table(
        f"round {number} abandoned", ("task", "round", "uploads dropped", "goes on from",
                                      "reason"),
        [(out["task_id"], out["round"], out["uploads"], f"v{out['version']}",
          out["reason"])]))


@round_app.command("schedule")
def round_schedule(task_id: str = TASK_ID,
                   auto: bool = typer.Option(None, "--auto/--manual", show_default=False,
                                             help="the coordinator opens the rounds back to "
                                             "back (--auto) or only `round open` does "
                                             "(--manual); default: unchanged"),
                   rounds: int = typer.Option(None, "--rounds", min=1, help="stop the "
                                              "automatic rounds at version N"),
                   no_limit: bool = typer.Option(False, "--no-limit", help="remove the "
                                                 "--rounds limit"),
                   url: str = URL, as_json: bool = AS_JSON,
                   admin_token: str = ADMIN_TOKEN) -> None:
    """Who opens the task's rounds from now on, and until which version."""
    if rounds is not None and no_limit:
        raise UsageError("give --rounds N or --no-limit, not both")
    schedule = None if auto is None else "auto" if auto else "manual"
    with admin(url, admin_token) as api:
        status = api.set_schedule(task_id, schedule=schedule, max_rounds=rounds,
                                  clear_limit=no_limit)
    _emit(status.model_dump(mode="json"), as_json, lambda: _table(
        f"rounds of {task_id}", ("schedule", "version", "waiting for"),
        [(_schedule_line(status), status.version, status.waiting)]))


# -- devices -------------------------------------------------------------------------------------
@devices_app.command("list")
def devices_list(task_id: str = TASK_ID, url: str = URL,
                 as_json: bool = AS_JSON, admin_token: str = ADMIN_TOKEN) -> None:
    """The task's devices: enrolment, last upload, revocation."""
    with admin(url, admin_token) as api:
        devices = list(api.request("GET", f"{Routes(task_id).task}/stats").json()["devices"])
    _emit(devices, as_json, lambda: _table(
        f"devices of {task_id}", ("device", "enrolled", "last seen", "uploads", "last round",
                                  "revoked"),
        [(d["device_id"], d["enrolled_at"], d["last_seen_at"], d["uploads"], d["last_round"],
          d["revoked_at"]) for d in devices]))


@devices_app.command("revoke")
def devices_revoke(task_id: str = TASK_ID,
                   device_id: str = typer.Argument(..., help="the device's id (`seedfed "
                                                   "devices list TASK`)"),
                   url: str = URL, as_json: bool = AS_JSON,
                   admin_token: str = ADMIN_TOKEN) -> None:
    """Revoke a device: its token stops working, its upload in an open round is not counted."""
    with admin(url, admin_token) as api:
        api.revoke_device(task_id, device_id)
    _emit({"task_id": task_id, "device_id": device_id, "revoked": True}, as_json,
          lambda: _table("revoked", ("task", "device"), [(task_id, device_id)]))


def register(app: typer.Typer) -> None:
    """Add the operator's command groups to the `seedfed` app."""
    app.add_typer(task_app, name="task")
    app.add_typer(round_app, name="round")
    app.add_typer(devices_app, name="devices")

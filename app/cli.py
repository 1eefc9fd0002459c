"""The `loraloom` command line (Typer)."""

import typer

cli = typer.Typer(help="loraloom: multi-tenant RL training service for LoRA adapters.", no_args_is_help=True)


@cli.command()
def version() -> None:
    """Print the version."""
    typer.echo("loraloom 0.1.0")


def main() -> None:
    cli()

"""``kvport demo``: the main job."""

from __future__ import annotations

import click


@click.command()
def demo() -> None:
    """Run the main job and print its report."""
    from kvport.demo.run import run

    run()

"""``kvport demo``: the main job."""

from __future__ import annotations

import click

from kvport.cli._params import writable_file
from kvport.errors import UserInputError


@click.command()
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="also write the report here")
@click.option("--users", default=3, show_default=True, type=click.IntRange(1, 4))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 4))
@click.option("--max-new-tokens", default=24, show_default=True, type=click.IntRange(1, 256))
@click.option("--engine", default="hf", show_default=True, type=click.Choice(["hf", "vllm"]),
              help="hf: kvport's own transformers workers; vllm: vllm serve engines behind kvport proxy")
@click.option("--tier", default="serve", show_default=True, type=click.Choice(["serve", "redis-cluster"]),
              help="the shared tier: a kvport serve (and a /dev/shm folder), or a Redis Cluster of 3 primaries "
                   "+ 3 replicas started here (--engine vllm)")
def demo(json_path: str | None, users: int, rounds: int, max_new_tokens: int, engine: str, tier: str) -> None:
    """Prefill/decode disaggregation of a multi-turn chat on the reference model, with a report."""
    if tier != "serve" and engine != "vllm":
        raise UserInputError(f"--tier {tier} runs with --engine vllm (the hf demo's shared tier is a kvport serve)")
    if json_path:
        writable_file(json_path, "--json")  # now, not after the demo
    if engine == "vllm":
        from pathlib import Path

        from rich.console import Console

        from kvport.demo.vllm_run import run

        summary = run(users, rounds, max_new_tokens, Path(json_path) if json_path else None, Console(), tier=tier)
        if not summary["outputs_equal_baseline"]:
            click.echo("kvport demo: outputs differ from recompute or the run failed (see above)", err=True)
            raise SystemExit(1)
        return
    from kvport.demo.run import main_cli

    main_cli(json_path, users, rounds, max_new_tokens)

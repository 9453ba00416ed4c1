"""``kvport demo``: the main job."""

from __future__ import annotations

import click

from kvport.cli._params import writable_file
from kvport.errors import UserInputError

# the keys of a config file the demo applies: the `kvport serve` it starts and its workers read them
# from their KVPORT_* variables (flags the demo gives its server, such as --capacity, still win)
_DEMO_KEYS = ("eviction.policy", "lifetimes.request_ttl_s", "lifetimes.session_ttl_s", "load_deadline")


def _apply_config(path: str) -> None:
    """Check the file (every problem, exit 2) and hand the keys the demo applies to its processes."""
    from kvport.config import export
    from kvport.configfile import env_name, load_config

    kv = load_config(path, role="engine")
    for w in kv.warnings:
        click.echo(f"kvport: warning: {w}", err=True)
    dl = kv.load_deadline
    text = {"eviction.policy": str(kv.eviction), "lifetimes.request_ttl_s": str(kv.lifetimes.request_ttl_s),
            "lifetimes.session_ttl_s": str(kv.lifetimes.session_ttl_s),
            "load_deadline": f"{dl.min_s}:{dl.factor}:{dl.max_s}"}
    export({env_name(k): text[k] for k in _DEMO_KEYS if kv.sets(k)})


@click.command()
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="also write the report here")
@click.option("--users", default=3, show_default=True, type=click.IntRange(1, 4),
              help="sessions, in this order: chat-log, agent-backup, agent-upload, chat-code")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 4))
@click.option("--max-new-tokens", default=12, show_default=True, type=click.IntRange(1, 256))
@click.option("--engine", default="hf", show_default=True, type=click.Choice(["hf", "vllm"]),
              help="hf: kvport's own transformers workers; vllm: vllm serve engines behind kvport proxy")
@click.option("--tier", default="serve", show_default=True, type=click.Choice(["serve", "redis-cluster"]),
              help="the shared tier: a kvport serve (and a /dev/shm folder), or a Redis Cluster of 3 primaries "
                   "+ 3 replicas started here (--engine vllm)")
@click.option("--layout", default="auto", show_default=True, type=click.Choice(["auto", "pd", "colocated"]),
              help="--engine vllm: pd (prefill and decode engines, kvport proxy), colocated (one engine on every "
                   "core, kvport its shared tier), or auto: the better one for this host (kvport.deploy.layout)")
@click.option("--config", "config_file", default=None, type=click.Path(dir_okay=False, exists=True), metavar="FILE",
              help="a kvport config file: checked before anything starts; its eviction policy, lifetimes and load "
                   "deadline apply to the demo's server and workers (the demo sizes its tiers, ports and limits "
                   "itself)")
def demo(json_path: str | None, users: int, rounds: int, max_new_tokens: int, engine: str, tier: str,
         layout: str, config_file: str | None) -> None:
    """Prefill/decode disaggregation of long chats and agent sessions on the reference model, with a report."""
    if tier != "serve" and engine != "vllm":
        raise UserInputError(f"--tier {tier} runs with --engine vllm (the hf demo's shared tier is a kvport serve)")
    if json_path:
        writable_file(json_path, "--json")  # now, not after the demo
    if config_file:
        _apply_config(config_file)
    if engine == "vllm":
        from pathlib import Path

        from rich.console import Console

        from kvport.demo.vllm_run import run

        summary = run(users, rounds, max_new_tokens, Path(json_path) if json_path else None, Console(), tier=tier,
                      layout=layout)
        if not summary["outputs_equal_baseline"]:
            click.echo("kvport demo: outputs differ from recompute or the run failed (see above)", err=True)
            raise SystemExit(1)
        return
    from kvport.demo.run import main_cli

    main_cli(json_path, users, rounds, max_new_tokens)

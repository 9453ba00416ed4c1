"""``kvport proxy``: the prefill/decode proxy (OpenAI API) in front of vLLM engines running KVPortConnector.

``python -m kvport.cli.proxy_cmd ARGS`` runs it without importing the rest of the CLI.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import click

from kvport.cli._params import as_bandwidth, as_seconds, as_seconds_or_zero
from kvport.cli._run import run_click, setup_logging
from kvport.cli.serve_cmd import parse_listen
from kvport.config import MIN_TOKEN_CHARS, Settings
from kvport.errors import ConfigError, KVPortError, UserInputError
from kvport.protocol.net import is_loopback

log = logging.getLogger(__name__)


@click.command(name="proxy")
@click.option("--listen", default="127.0.0.1:8000", show_default=True, help="HOST:PORT the OpenAI API is served on")
@click.option("--prefill", "prefill", multiple=True, metavar="URL",
              help="a prefill engine (vllm serve with kv_role kv_producer), e.g. http://127.0.0.1:8100; repeatable")
@click.option("--decode", "decode", multiple=True, metavar="URL",
              help="a decode engine (vllm serve with kv_role kv_consumer); repeatable")
@click.option("--engine", "engines", multiple=True, metavar="URL",
              help="an engine that computes whole requests (kv_role kv_both, or no connector), instead of "
                   "--prefill/--decode: each request goes to one of them; repeatable")
@click.option("--route", "route", type=click.Choice(["round_robin", "least_loaded", "prefix"]), default="round_robin",
              show_default=True,
              help="which engine of a role gets a request: in turn, the one with the fewest requests (its /metrics), "
                   "or prefix: the lowest predicted time to first token from the prompt blocks it already holds "
                   "(its KV events, --kv-events) and its load")
@click.option("--kv-events", "kv_events", multiple=True, metavar="URL=ENDPOINT[,REPLAY]",
              help="where an engine publishes its KV events (vllm serve --kv-events-config endpoint and "
                   "replay_endpoint, e.g. ipc:///run/kv-8100,ipc:///run/kv-8100-replay); repeatable")
@click.option("--route-block-size", "route_block_size", default=None, type=click.IntRange(min=1),
              help="the engines' KV block size (default: learned from their KV events)")
@click.option("--route-profile", "route_profile", default=None, type=click.Path(dir_okay=False, exists=True),
              help="the planner's calibration profile (kvport calibrate): the prefix policy's prefill and load costs "
                   "(with --kv-bytes-per-token for the loads); default: built-in costs")
@click.option("--route-stale", "route_stale", default=30.0, show_default=True, type=float, callback=as_seconds,
              help="seconds after which an engine not heard from (KV events or /metrics) gets no requests")
@click.option("--decode-inbox", "decode_inbox", multiple=True, metavar="INBOX[,INBOX...]",
              help="a decode engine's kvport_pd_inbox, one per --decode in the same order: HOST:PORT (TCP) or "
                   "shm:NAME (shared memory, an engine on this host); at tensor parallel size N its N rank inboxes, "
                   "comma-separated. Prefill engines stream the KV there layer by layer during the prefill; "
                   "repeatable")
@click.option("--prefill-timeout", default=300.0, show_default=True, type=float, callback=as_seconds,
              help="seconds a prefill may take before the decode engine computes the prompt itself")
@click.option("--decode-timeout", default=600.0, show_default=True, type=float, callback=as_seconds,
              help="seconds a whole answer may take")
@click.option("--header-timeout", default=10.0, show_default=True, type=float, callback=as_seconds,
              help="seconds a client has to send a request's head (from connecting or its previous answer)")
@click.option("--body-timeout", default=30.0, show_default=True, type=float, callback=as_seconds,
              help="seconds a client has to send a request's body (408 past it)")
@click.option("--pd", "pd_policy", type=click.Choice(["stream", "recompute", "plan"]), default="stream",
              show_default=True,
              help="per request: stream the prompt's KV from a prefill engine, let the decode engine compute it, or "
                   "plan: whichever the live cost model, learned from this proxy's own requests, predicts gives the "
                   "first token sooner (a request's X-KVport-PD header overrides)")
@click.option("--pd-link", "pd_link", default=None, callback=as_bandwidth, metavar="RATE",
              help="the stream's link rate for the planner (e.g. 1Gbps, 10Gbps); with --kv-bytes-per-token, "
                   "what a slow link adds to a stream is predicted, not only learned")
@click.option("--pd-link-latency", "pd_link_latency", default=0.0, show_default=True, type=float,
              callback=as_seconds_or_zero, help="the stream's link latency in seconds, one way")
@click.option("--kv-bytes-per-token", "kv_bytes_per_token", default=None, type=click.IntRange(min=1),
              help="the model's KV bytes per token (kvport size --json: bytes_per_token)")
def proxy_cmd(listen: str, prefill: tuple[str, ...], decode: tuple[str, ...], engines: tuple[str, ...], route: str,
              kv_events: tuple[str, ...], route_block_size: int | None, route_profile: str | None,
              route_stale: float,
              decode_inbox: tuple[str, ...], prefill_timeout: float, decode_timeout: float, header_timeout: float,
              body_timeout: float, pd_policy: str, pd_link: float | None, pd_link_latency: float,
              kv_bytes_per_token: int | None) -> None:
    """Serve /v1/completions and /v1/chat/completions: prefill on one engine, decode on another (or
    each request on one of --engine), each engine chosen by --route."""
    for flag, urls in (("--prefill", prefill), ("--decode", decode), ("--engine", engines)):
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise click.BadParameter(f"an engine URL starts with http:// or https://, got {url!r}", param_hint=flag)
    if engines and (prefill or decode):
        raise click.BadParameter("give --engine (whole requests) or --prefill and --decode, not both",
                                 param_hint="--engine")
    if not engines and not prefill:
        raise click.BadParameter("at least one --prefill engine (with --decode), or --engine", param_hint="--prefill")
    if not engines and not decode:
        raise click.BadParameter("at least one --decode engine (with --prefill), or --engine", param_hint="--decode")
    host, port = parse_listen(listen)
    token = Settings.from_env().auth_token
    if not is_loopback(host) and not token:
        raise UserInputError(f"--listen {listen}: beyond this machine the proxy needs KVPORT_AUTH_TOKEN "
                             "(every request must then carry it as a bearer token)")
    if not is_loopback(host) and token is not None and len(token) < MIN_TOKEN_CHARS:
        raise UserInputError(f"--listen {listen}: KVPORT_AUTH_TOKEN is shorter than {MIN_TOKEN_CHARS} characters; "
                             f"beyond this machine the proxy needs a token of at least {MIN_TOKEN_CHARS}, "
                             "as kvport serve does")
    from kvport.proxy.service import ProxyConfig, serve_proxy

    profile = None
    if route_profile is not None:
        from kvport.planner import Profile

        try:
            profile = Profile.load(route_profile)
        except (KVPortError, OSError, ValueError) as exc:
            raise click.BadParameter(f"not a calibration profile: {exc}", param_hint="--route-profile") from exc

    try:
        cfg = ProxyConfig(prefill=prefill, decode=decode, host=host, port=port, auth_token=token,
                          prefill_timeout_s=prefill_timeout, decode_timeout_s=decode_timeout,
                          header_timeout_s=header_timeout, body_timeout_s=body_timeout, decode_inbox=decode_inbox,
                          pd_policy=pd_policy, pd_link_bps=pd_link, pd_link_latency_s=pd_link_latency,
                          kv_bytes_per_token=kv_bytes_per_token, engines=engines, route=route, kv_events=kv_events,
                          route_block_size=route_block_size, route_stale_s=route_stale, route_profile=profile,
                          load_poll_s=min(1.0, route_stale / 2))
    except ConfigError as exc:
        raise UserInputError(str(exc)) from exc
    if route == "prefix" and not kv_events:
        log.warning("kvport proxy: --route prefix without --kv-events: no engine's blocks are known, every "
                    "request goes to the least loaded engine")
    asyncio.run(serve_proxy(cfg))


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    return run_click(proxy_cmd, argv, "kvport proxy")


if __name__ == "__main__":
    sys.exit(main())

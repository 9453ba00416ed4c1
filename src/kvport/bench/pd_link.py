"""Prefill/decode in vLLM across an emulated link, the proxy's planner choosing per request between the
streamed hand-off and recompute (``kvport bench scaleout``'s ``links.NAME.pd_*``).

::

    namespace A (the prefill host)              namespace B (the decode host)
      vllm serve, kv_producer  --- the KV, streamed layer by layer -->  vllm serve, kv_consumer (its inbox)
      cores ``prefill_cores``     over the shaped veth (HMAC link;      cores ``decode_cores``
                                  TCP, or NIXL with UCX on TCP)
                               <-- the one-token prefill request ---   kvport proxy --pd plan  <-- this process
                                                                        (the client, in B)

The default cores make the prefill host the compute-rich one (both cores for the prefill engine,
one for the decode engine): that is when streaming can pay, and on two cores it is the only way to
give the two hosts different compute. With equal compute (``--set pd_cores=0/1``) the decode engine
computes every prompt as fast as the prefill engine, and recompute should win at every length.

1. **Warm-up**: two hand-offs and two recomputes at a length of their own, straight to the engines
   (an engine's first requests run 2-7x slower; the proxy's planner never sees them).
2. **Calibration**: through the proxy, each path forced (``X-KVport-PD: stream`` / ``recompute``) at
   lengths never validated; the planner fits its curves from these requests alone
   (:mod:`kvport.planner.pd`); its predicted crossover is read from ``/kvport/pd``.
3. **Validation**: per length and trial, the same prompt three times (a ``cache_salt`` each, so no
   cache of any engine or of kvport hits): always stream, always recompute, and the planner's choice,
   in rotating order. The client's time to the first streamed token is the TTFT.

Results: ``pd_ttft_vs_best_option`` (mean TTFT with the planner over the better of the two fixed
policies' means, the same requests), per length the three means, the planner's choice and its
predictions, ``planner_picked_best`` (lengths where the planner's path was the measured faster one
or within 10% of it), the crossover predicted (the fitted curves) and measured (where the two fixed
policies' means cross, interpolated), ``short_recompute_long_stream``, ``tokens_equal`` (the three
answers to each prompt), ``streamed_tokens_loaded`` (the prompt tokens the decode engine counted as
external KV transfers during validation, over the whole-block tokens of the streamed requests: 1.0
when every hand-off was loaded, none recomputed).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvport.bench.harness import crossing
from kvport.bench.pd import Answer, completion_body, prompt_tokens, request
from kvport.config import Settings
from kvport.deploy.vllm_serve import EngineServer, ProxyServer, free_port, listen_port, stop_on_sigterm
from kvport.errors import ConfigError
from kvport.evidence.netlink import ShapedLink, in_netns
from kvport.proxy.service import PATH_HEADER, PD_HEADER, PREDICTED_HEADER

BLOCK = 32
ANSWER_TOKENS = 4
FULL_CAL = (48, 128, 320, 768, 1536)
FULL_VAL = (32, 96, 224, 512, 1024, 2000)
QUICK_CAL = (48, 160, 480)
QUICK_VAL = (64, 256, 768)
WARMUP_TOKENS = 400
POLICIES = ("stream", "recompute", "plan")


def default_cores() -> tuple[str, str]:
    """(prefill, decode) cores: every core for the prefill host, the last one for the decode host."""
    n = os.cpu_count() or 1
    return (f"0-{n - 1}" if n > 1 else "0"), str(n - 1)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _salt(rng: random.Random) -> str:
    return f"pd-link-{rng.getrandbits(64):016x}"


def _ask(proxy: ProxyServer, prompt: list[int], policy: str, rng: random.Random) -> Answer:
    body = completion_body(prompt, ANSWER_TOKENS, cache_salt=_salt(rng))
    return request(proxy.url + "/v1/completions", body, headers={PD_HEADER: policy})


def _warmup(pre: EngineServer, dec: EngineServer, inbox: str, rng: random.Random) -> None:
    for _ in range(2):
        p, salt = _prompt(rng, WARMUP_TOKENS), _salt(rng)  # one salt for both halves: it is in the blocks' keys
        t = request(pre.url + "/v1/completions", {**completion_body(p, 1, cache_salt=salt), "stream": False,
                                                   "stream_options": None,
                                                   "kv_transfer_params": {"do_remote_decode": True,
                                                                          "kvport_dest": inbox}})
        request(dec.url + "/v1/completions", completion_body(p, 2, cache_salt=salt,
                                                             kv_transfer_params=t.kv_transfer_params))
        request(dec.url + "/v1/completions", completion_body(_prompt(rng, WARMUP_TOKENS), 2, cache_salt=_salt(rng)))


def _state(proxy: ProxyServer) -> dict[str, Any]:
    with urllib.request.urlopen(proxy.url + "/kvport/pd", timeout=10) as r:
        got: dict[str, Any] = json.loads(r.read())
    return got


def run_on_link(link: ShapedLink, *, quick: bool, trials: int | None = None, cores: tuple[str, str] | None = None,
                keep: Path | None = None, stream: str = "tcp") -> dict[str, Any]:
    """The whole measurement on an up ``link`` (module docstring); raises EngineError when an engine
    cannot start. ``stream``: the hand-off's link, ``tcp`` (kvport's TCP transport) or ``nixl``
    (``nixl:HOST:PORT``, UCX held to TCP: on one host it would otherwise pick cross-memory attach and
    bypass the emulated link)."""
    if stream not in ("tcp", "nixl"):
        raise ConfigError(f"the hand-off across a link streams over tcp or nixl, got {stream!r}")
    from kvport.engines.vllm.identity import engine_spec

    settings = Settings.from_env()
    model = settings.model_dir
    spec = engine_spec(str(model), dtype="float32", block_size=BLOCK)
    cal, val = (QUICK_CAL, QUICK_VAL) if quick else (FULL_CAL, FULL_VAL)
    trials = trials or (1 if quick else 3)
    pre_cores, dec_cores = cores or default_cores()
    rng = random.Random(28)
    with tempfile.TemporaryDirectory(prefix="kvport-pd-link-", dir=keep) as d, stop_on_sigterm():
        root = Path(d)
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
        stores = [tempfile.mkdtemp(prefix=f"kvport-pd-link-{side}-", dir=shm) for side in "ab"]
        inbox = f"{'nixl:' if stream == 'nixl' else ''}{link.addr[1]}:{listen_port()}"
        ucx = {"UCX_TLS": "tcp,self"} if stream == "nixl" else {}
        pre = EngineServer(model, free_port(), role="kv_producer", host=link.addr[0], netns=link.ns[0],
                           extra={"kvport_disk_dir": stores[0], "kvport_pd_destinations": [inbox]},
                           log=root / "prefill.log", env={"VLLM_CPU_OMP_THREADS_BIND": pre_cores, **ucx})
        dec = EngineServer(model, free_port(), role="kv_consumer", host=link.addr[1], netns=link.ns[1],
                           extra={"kvport_disk_dir": stores[1], "kvport_pd_inbox": inbox},
                           log=root / "decode.log", env={"VLLM_CPU_OMP_THREADS_BIND": dec_cores, **ucx})
        proxy = ProxyServer([pre.url], [dec.url], root / "proxy.log", decode_inbox=[inbox], netns=link.ns[1],
                            args=["--pd", "plan", "--pd-link", f"{link.shape.rate_mbit:g}Mbps",
                                  "--kv-bytes-per-token", str(spec.bytes_per_token)])
        try:
            for e in (pre, dec):
                e.start()
            for e in (pre, dec):
                e.wait_healthy(400)
            proxy.start()
            with in_netns(link.ns[1]):  # this thread is the client, on the decode host
                return _measure(link, pre, dec, proxy, inbox, cal, val, trials, rng,
                                {"prefill_cores": pre_cores, "decode_cores": dec_cores, "inbox": inbox,
                                 "stream": stream + (" (UCX_TLS=tcp,self)" if stream == "nixl" else ""),
                                 "kv_bytes_per_token": spec.bytes_per_token})
        finally:
            proxy.stop()
            for e in (pre, dec):
                e.stop()
            for s in stores:
                shutil.rmtree(s, ignore_errors=True)


def _measure(link: ShapedLink, pre: EngineServer, dec: EngineServer, proxy: ProxyServer, inbox: str,
             cal: Sequence[int], val: Sequence[int], trials: int, rng: random.Random,
             setup: dict[str, Any]) -> dict[str, Any]:
    _warmup(pre, dec, inbox, rng)
    for n in cal:  # the planner learns from these only (forced paths, lengths never validated)
        for _ in range(2):
            for policy in ("stream", "recompute"):
                _ask(proxy, _prompt(rng, n), policy, rng)
    learned = _state(proxy)
    ttft: dict[tuple[int, str], list[float]] = {}
    picks: dict[int, list[str]] = {}
    predicted: dict[int, str] = {}
    equal = total = 0
    streamed = 0  # prompt tokens in whole blocks of the streamed requests: what their hand-offs carry
    external = prompt_tokens(dec.url, "external_kv_transfer")
    for t in range(trials):
        for i, n in enumerate(val):
            prompt = _prompt(rng, n)
            order = POLICIES[(i + t) % 3:] + POLICIES[:(i + t) % 3]  # rotating: drift hits every policy alike
            got: dict[str, Answer] = {}
            for policy in order:
                a = _ask(proxy, prompt, policy, rng)
                got[policy] = a
                ttft.setdefault((n, policy), []).append(a.ttft_s or a.wall_s)
                if policy == "plan":
                    picks.setdefault(n, []).append(a.headers.get(PATH_HEADER, "?"))
                    predicted[n] = a.headers.get(PREDICTED_HEADER, "")
                if a.headers.get(PATH_HEADER) == "stream":
                    streamed += (n - 1) // BLOCK * BLOCK
            total += 1
            equal += got["stream"].text == got["recompute"].text == got["plan"].text
    external = prompt_tokens(dec.url, "external_kv_transfer") - external
    mean = {k: statistics.fmean(v) for k, v in ttft.items()}
    rows = []
    plan_sum = 0.0
    picked_best = 0
    for n in val:
        s, r, p = mean[(n, "stream")], mean[(n, "recompute")], mean[(n, "plan")]
        choice = max(set(picks[n]), key=picks[n].count)
        best = "stream" if s < r else "recompute"
        picked_best += {"stream": s, "recompute": r}.get(choice, float("inf")) <= 1.1 * min(s, r)
        plan_sum += p
        rows.append({"tokens": n, "stream_ttft_s": round(s, 4), "recompute_ttft_s": round(r, 4),
                     "plan_ttft_s": round(p, 4), "planner_choice": choice, "planner_choices": picks[n],
                     "measured_best": best, "predicted": predicted.get(n)})
    stream_mean = statistics.fmean(mean[(n, "stream")] for n in val)
    recompute_mean = statistics.fmean(mean[(n, "recompute")] for n in val)
    best_fixed = min(stream_mean, recompute_mean)
    plan_mean = plan_sum / len(val)
    end = _state(proxy)
    return {
        "pd_ttft_vs_best_option": round(plan_mean / best_fixed, 4),
        "pd_ttft_mean_s": {"plan": round(plan_mean, 4), "stream": round(stream_mean, 4),
                           "recompute": round(recompute_mean, 4)},
        "pd_planner_picked_best": round(picked_best / len(val), 4),
        "pd_short_recompute_long_stream": rows[0]["planner_choice"] == "recompute"
                                          and rows[-1]["planner_choice"] == "stream",
        "pd_crossover_tokens": {"predicted_after_calibration": learned.get("crossover_tokens"),
                                "predicted_at_end": end.get("crossover_tokens"),
                                "measured": crossing(val, [mean[(n, "stream")] for n in val],
                                                     [mean[(n, "recompute")] for n in val])},
        "pd_tokens_equal": equal == total, "pd_prompts_compared": total,
        "pd_streamed_tokens_loaded": round(external / streamed, 4) if streamed else None,
        "pd_lengths": rows,
        "pd_setup": {**setup, "calibration_lengths": list(cal), "validation_lengths": list(val), "trials": trials,
                     "answer_tokens": ANSWER_TOKENS, "link": link.name,
                     "prefill_engine": f"{pre.host} in {pre.netns}", "decode_engine_and_proxy": f"{dec.host} in "
                     f"{dec.netns}", "prompts": "random token ids, a cache_salt per request (no cache hits)",
                     "ttft": "client: request sent to the proxy -> first streamed token"},
        "pd_planner_after_calibration": {k: learned.get(k) for k in ("curves", "crossover_tokens", "link")},
        "pd_planner_decisions": end.get("decisions"),
    }

"""``kvport bench planner``: is the planner's choice the fastest option when every option is really run?

On the reference model (fp32, ``threads`` torch threads, default 1), for each link bandwidth and
prompt length ``N`` (the first ``N - suffix`` tokens' KV held by a peer process on loopback):

1. calibrate in this run: prefill at lengths *other* than the validation lengths (plus incremental
   prefills after a cached context), install speed, and every token-bucket link itself (latency +
   bandwidth of a probe transfer); bandwidths are set around the rate at which a full prefill
   produces KV (``factors`` x that rate), so the sweep straddles the crossovers on any machine;
2. decide each cell twice: from the calibration profile alone (``static_profile``) and with the
   live ``Planner`` that has folded every earlier run of this sweep into its estimates
   (``observe_prefill`` / ``observe_transfer``; the headline numbers);
3. measure every option for real: ``recompute`` (prefill N tokens), ``load`` (receive the cached
   blocks over the throttled link, build the DynamicCache, prefill the suffix) and ``split``
   (recompute the head the profile picked while a thread receives the tail, join, prefill the
   suffix); trials run round-robin over the options and the fastest is kept. Logits of every path
   are compared with recompute's.

``--set link=NAME`` (:data:`kvport.evidence.netlink.LINKS`): the peer is the other host of an
emulated link (two network namespaces, a shaped veth): every transfer crosses it, and the link's own
rate is one more bandwidth of the sweep (``results.link`` describes it; ``planner_within_10pct`` of
``kvport bench scaleout``'s links comes from this run).

Results: ``cells``, ``within_10pct_of_best``, ``max_regret``, ``crossover`` per bandwidth (measured:
where load - recompute changes sign between lengths, linearly interpolated; predicted: the cost
model's), and whether split beat both pure options anywhere. Limits: the raw (unthrottled) loopback
transfer and memcpy of the same bytes, measured in the same run. Codec options are not part of this
sweep (fp32 KV, lossless budget); ``kvport bench codec`` measures codecs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvport.bench.harness import Report, SuiteOptions, conditions, crossing, finish
from kvport.config import Settings
from kvport.evidence.limits import memcpy_gbps
from kvport.evidence.netlink import ShapedLink
from kvport.planner import Action, Cached, Freshness, Planner, Profile, Request, crossover, evaluate, hfkv, machine_id
from kvport.planner.calibrate import PrefillPlan, measure_install, measure_link, prefill_model, reference_ids
from kvport.planner.profile import PrefillModel
from kvport.planner.throttle import LoopbackPeer
from kvport.refmodel import MODEL_ID, load
from kvport.spec import KVSpec, from_hf_config


@dataclass(frozen=True, slots=True)
class Sweep:
    lengths: tuple[int, ...]  # validation prompt lengths (never used for calibration)
    suffix: int  # uncached tail of every prompt
    factors: tuple[float, ...]  # bandwidths = factor x the predicted crossover bandwidth at the middle length
    trials: int  # runs per measured option; the fastest is kept (other jobs share this machine)
    plan: PrefillPlan


FULL = Sweep((96, 192, 384, 768), 64, (0.5, 1.0, 2.0, 4.0, 16.0), 2,
             PrefillPlan(lengths=(32, 64, 128, 256, 512), incremental=((256, 64), (448, 64), (448, 128)),
                         trials=3, best_of=True))
QUICK = Sweep((32, 64, 128), 16, (0.5, 3.0), 1,
              PrefillPlan(lengths=(16, 32, 64, 128), incremental=((64, 16), (96, 32)), trials=1, best_of=True))


class _Runner:
    """Runs the three options for real against one peer; buffers are allocated once and reused."""

    def __init__(self, model: Any, ids: torch.Tensor, spec: KVSpec, peer: LoopbackPeer) -> None:
        self.model, self.ids, self.spec, self.peer = model, ids, spec, peer
        self.buf = np.empty(peer.capacity, dtype=np.uint8)
        self.view = memoryview(self.buf.data).cast("B")

    def recompute(self, n: int) -> tuple[float, torch.Tensor]:
        out, secs = hfkv.forward(self.model, self.ids, 0, n)
        return secs, hfkv.last_logits(out)

    def load(self, n: int, reuse: int, rate: float) -> tuple[float, torch.Tensor, float, float]:
        """(total, logits, transfer seconds, suffix prefill seconds)."""
        bs, bpb = self.spec.block_size, self.spec.bytes_per_block
        t0 = time.perf_counter()
        moved = self.peer.get_into(0, self.view[: reuse // bs * bpb], rate)
        cache = hfkv.blocks_to_cache(self.buf, self.spec, reuse // bs, self.model.config)
        out, suffix = hfkv.forward(self.model, self.ids, reuse, n, cache)
        return time.perf_counter() - t0, hfkv.last_logits(out), moved, suffix

    def split(self, n: int, reuse: int, head: int, rate: float) -> tuple[float, torch.Tensor]:
        bs, bpb = self.spec.block_size, self.spec.bytes_per_block
        lo, hi = head // bs * bpb, reuse // bs * bpb
        err: list[BaseException] = []

        def fetch() -> None:
            try:
                self.peer.get_into(lo, self.view[lo:hi], rate)
            except BaseException as exc:  # re-raised in the caller's thread
                err.append(exc)

        t0 = time.perf_counter()
        th = threading.Thread(target=fetch, name="kvport-split-fetch")
        th.start()
        head_out, _ = hfkv.forward(self.model, self.ids, 0, head)
        th.join()
        if err:
            raise err[0]
        cache = hfkv.blocks_to_cache(self.buf[lo:hi], self.spec, (reuse - head) // bs, self.model.config,
                                     head=head_out.past_key_values)
        out, _ = hfkv.forward(self.model, self.ids, reuse, n, cache)
        return time.perf_counter() - t0, hfkv.last_logits(out)


def _reuse(spec: KVSpec, n: int, cached: int) -> int:
    r = min(cached, n - 1)
    return r - r % spec.block_size


def prefill_bandwidth(pf: PrefillModel, spec: KVSpec, n: int) -> float:
    """KV bytes per second a full prefill of ``n`` tokens produces: the link speed where moving KV
    and recomputing it cost the same, before overheads (the centre of the bandwidth sweep)."""
    return spec.request_bytes(n) / pf.seconds(0, n)


def _sweep(opts: SuiteOptions) -> Sweep:
    sw = QUICK if opts.quick else FULL
    x = opts.extra
    if "lengths" in x:
        sw = replace(sw, lengths=tuple(sorted(int(n) for n in x["lengths"])))
    if "suffix" in x:
        sw = replace(sw, suffix=int(x["suffix"]))
    if "factors" in x:
        sw = replace(sw, factors=tuple(float(f) for f in x["factors"]))
    if "trials" in x:
        sw = replace(sw, trials=max(1, int(x["trials"])))
    return sw


def _score(cells: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    regrets = [c[key]["regret"] for c in cells if c[key]["regret"] is not None]
    if not regrets:
        return {"within_10pct_of_best": None, "max_regret": None}
    return {"within_10pct_of_best": round(sum(r <= 0.10 for r in regrets) / len(regrets), 4),
            "max_regret": round(max(regrets), 4)}


def _judge(choice: str, measured: dict[str, float]) -> dict[str, Any]:
    best = min(measured.values())
    got = measured.get(choice)
    return {"action": choice, "regret": None if got is None else round(got / best - 1, 4)}


def run(opts: SuiteOptions) -> Report:
    sw = _sweep(opts)
    threads = opts.number("threads", 1, lo=1, integer=True)
    lengths, suffix, trials, plan = list(sw.lengths), sw.suffix, sw.trials, sw.plan
    torch.set_num_threads(threads)
    settings = Settings.from_env()
    model, tok = load(settings.model_dir)
    spec = from_hf_config(settings.model_dir, dtype="fp32", model_id=MODEL_ID)
    ids = reference_ids(tok, max(lengths[-1], plan.max_tokens))

    # 1. calibrate prefill and install (validation lengths are never calibration lengths)
    pf = prefill_model(model, ids, spec, plan)
    install = measure_install(model, ids, spec, min(256, lengths[-1]))
    rmax = _reuse(spec, lengths[-1], lengths[-1] - suffix)
    full_out, _ = hfkv.forward(model, ids, 0, lengths[-1])
    kv = np.empty(spec.request_bytes(rmax), dtype=np.uint8)
    hfkv.cache_to_blocks(full_out.past_key_values, spec, 0, rmax, kv)
    limits: dict[str, Any] = {"memcpy_gbps": round(memcpy_gbps(kv.nbytes, trials=3), 3)}

    cells: list[dict[str, Any]] = []
    max_logit_diff = 0.0
    link_name = opts.extra.get("link")
    link = None if link_name is None else ShapedLink(str(link_name)).start()
    try:
        peer = LoopbackPeer(kv.nbytes, link=link)
    except BaseException:
        if link is not None:
            link.close()
        raise
    with peer, contextlib.nullcontext() if link is None else contextlib.closing(link):
        peer.put(0, kv.data)
        raw = measure_link(peer, "loopback" if link is None else f"link {link.name}", 0.0, kv.nbytes)
        limits["loopback_tcp_gbps" if link is None else "link_tcp_gbps"] = round(raw.bandwidth / 1e9, 3)
        limits["loopback_latency_s" if link is None else "link_latency_s"] = raw.latency
        runner = _Runner(model, ids, spec, peer)
        b_star = prefill_bandwidth(pf, spec, lengths[len(lengths) // 2])
        rates = opts.extra.get("bandwidths_mbps")
        ceiling = 0.8 * raw.bandwidth
        bandwidths = ([float(b) * 1e6 for b in rates] if rates else
                      sorted({round(min(ceiling, max(1e6, b_star * f)), -4) for f in sw.factors}))
        if link is not None:  # the link at its own rate: the bucket at the shaped rate on top of it
            bandwidths = sorted({*bandwidths, link.shape.rate_bps})
        # 2. calibrate every throttled link; one profile holds them all (link i = bandwidth i)
        links = [measure_link(peer, f"peer{i}", b, int(min(kv.nbytes, max(1 << 20, b * 0.25))), scratch=runner.buf)
                 for i, b in enumerate(bandwidths)]
        static = Profile(machine=machine_id(), created=time.time(), prefill=pf, links=tuple(links),
                         install_bps=install)
        online = Planner(static, machine=machine_id())  # learns from every run below (EMA)
        # 3. per length: decide, then measure every option, trials interleaved round-robin so a burst of
        #    load from other jobs on this machine hits different options in different trials
        for n in lengths:
            reuse = _reuse(spec, n, n - suffix)
            reqs = [Request(n, spec, (Cached(lk.name, n - suffix),)) for lk in links]
            d_static = [evaluate(static, r, fresh=online.freshness()) for r in reqs]
            d_online = [online.decide(r) for r in reqs]
            runs: dict[tuple[int, str], list[float]] = {}
            rec_runs: list[float] = []
            for _ in range(trials):
                secs, logits = runner.recompute(n)
                rec_runs.append(secs)
                online.observe_prefill(n, secs)
                ref = logits
                for i, rate in enumerate(bandwidths):
                    total, logits, moved, sfx = runner.load(n, reuse, rate)
                    max_logit_diff = max(max_logit_diff, float((logits - ref).abs().max()))
                    runs.setdefault((i, "load"), []).append(total)
                    online.observe_transfer(spec.request_bytes(reuse), moved, links[i].name)
                    online.observe_prefill(n - reuse, sfx, cached=reuse)
                    split = next(o for o in d_static[i].options if o.action is Action.SPLIT)
                    if split.seconds is not None:
                        total, logits = runner.split(n, reuse, split.head_tokens, rate)
                        max_logit_diff = max(max_logit_diff, float((logits - ref).abs().max()))
                        runs.setdefault((i, "split"), []).append(total)
            for i, rate in enumerate(bandwidths):
                measured = {"recompute": min(rec_runs)}
                measured.update({a: min(v) for (j, a), v in runs.items() if j == i})
                split = next(o for o in d_static[i].options if o.action is Action.SPLIT)
                cells.append({
                    "bandwidth_mbps": round(rate / 1e6, 2), "link_measured_mbps": round(links[i].bandwidth / 1e6, 2),
                    "tokens": n, "cached": reuse, "split_head": split.head_tokens or None,
                    "best": min(measured, key=lambda k: measured[k]),
                    "static": _judge(d_static[i].action.value, measured),
                    "online": _judge(d_online[i].action.value, measured),
                    "reason": d_online[i].reason,
                    "predicted_s": {o.action.value: None if o.seconds is None else round(o.seconds, 4)
                                    for o in d_static[i].options},
                    "measured_s": {k: round(v, 4) for k, v in measured.items()},
                })
    learned = online.profile
    state = {"prefill_scale": None if learned is None or learned.prefill is None else round(learned.prefill.scale, 4),
             "link_mbps": {lk.name: round(lk.bandwidth / 1e6, 2) for lk in (learned.links if learned else ())}}
    res = _results(cells, lengths, bandwidths, links, static, spec, suffix, pf, install, b_star, max_logit_diff)
    res["online_state_at_end"] = state
    res["link"] = None if link is None else {"name": link.name, **link.describe()}
    return finish(Report("planner", _conditions(spec, threads, lengths, suffix, trials), limits, res))


def _conditions(spec: KVSpec, threads: int, lengths: list[int], suffix: int, trials: int) -> dict[str, Any]:
    return conditions(model=MODEL_ID, dtype="fp32", threads=threads, lengths=lengths, suffix_tokens=suffix,
                      trials=trials, timing="fastest of trials, trials interleaved across options (shared machine)",
                      link="tcp 127.0.0.1, token bucket in the peer process", bytes_per_token=spec.bytes_per_token)


def _results(cells: list[dict[str, Any]], lengths: list[int], bandwidths: list[float], links: list[Any],
             static: Profile, spec: KVSpec, suffix: int, pf: PrefillModel, install: float, b_star: float,
             max_logit_diff: float) -> dict[str, Any]:
    crossovers = []
    for i, rate in enumerate(bandwidths):
        mine = [c for c in cells if c["bandwidth_mbps"] == round(rate / 1e6, 2)]
        loads = [c["measured_s"]["load"] for c in mine]
        recs = [c["measured_s"]["recompute"] for c in mine]
        pred = crossover(static, spec, links[i].name, suffix, lo=lengths[0], hi=lengths[-1],
                         fresh=Freshness(now=static.created))
        crossovers.append({
            "bandwidth_mbps": round(rate / 1e6, 2),
            "measured_tokens": crossing(lengths, loads, recs),
            "predicted_tokens": pred.lengths[0] if pred.lengths else None,
            "predicted": pred.describe(),
            "recompute_wins_at_shortest": {"measured": loads[0] > recs[0], "predicted": pred.recompute_wins_at_lo},
        })
    split_wins = []
    for c in cells:
        m = c["measured_s"]
        if "split" in m and m["split"] < min(m["load"], m["recompute"]):
            split_wins.append({"bandwidth_mbps": c["bandwidth_mbps"], "tokens": c["tokens"],
                               "gain_vs_best_pure": round(1 - m["split"] / min(m["load"], m["recompute"]), 4)})
    online, static_score = _score(cells, "online"), _score(cells, "static")
    return {
        "cells": cells,
        "within_10pct_of_best": online["within_10pct_of_best"],
        "max_regret": online["max_regret"],
        "static_profile": static_score,
        "scoring": "online = Planner with live EMA updates from the runs before each decision (as deployed); "
                   "static_profile = the calibration profile alone",
        "crossover": crossovers,
        "split_beats_both": {"cells": len(split_wins), "where": split_wins,
                             "note": None if split_wins else
                             "split never beat both pure options: overlapping the head prefill with the tail "
                             "transfer did not pay on this machine at these sizes"},
        "max_logit_abs_diff_vs_recompute": max_logit_diff,
        "profile": {"prefill": {"a": pf.a, "x": pf.x, "b": pf.b, "c": pf.c, "d": pf.d,
                                "points": [[p.start, p.end, round(p.seconds, 4)] for p in pf.points]},
                    "install_gbps": round(install / 1e9, 3),
                    "prefill_kv_mbps_at_mid_length": round(b_star / 1e6, 2)},
        "bandwidths_mbps": [round(b / 1e6, 2) for b in bandwidths],
    }

"""Quality of KV codecs on the reference model: perplexity vs the unquantized baseline, next-token
top-1 agreement and KL, beside the size ratio the codec really achieved, under stated conditions.

Method (per text set, per window): one fp32 forward with plain SDPA gives the baseline log-probs;
then, for each codec, one forward whose every attention call reads K (after RoPE) and V encoded and
decoded by the codec (:mod:`kvport.eval.attention`). Every token of the window is encoded, the
sink and the most recent tokens included: the harsh case in which a whole context is loaded from a
tier. Metrics over the window's predicted positions 1..T-1::

    ppl            exp(mean NLL of the true next token)
    delta_pct      100 * (ppl_codec / ppl_base - 1)
    top1_agreement share of positions where argmax(codec) == argmax(baseline)
    kl             mean KL(baseline || codec) in nats
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvport.codec import Codec, codec_key
from kvport.eval import attention
from kvport.eval.texts import TEXT_SETS, windows
from kvport.spec import DType


@dataclass(frozen=True, slots=True)
class QualityOptions:
    tokens: int = 1024
    windows: int = 4
    sets: tuple[str, ...] = TEXT_SETS
    kv_dtype: DType = DType.FP32


@dataclass(slots=True)
class _Acc:
    nll: float = 0.0
    agree: int = 0
    kl: float = 0.0
    n: int = 0

    def add(self, nll: float, agree: int, kl: float, n: int) -> None:
        self.nll += nll
        self.agree += agree
        self.kl += kl
        self.n += n


@dataclass(slots=True)
class CodecQuality:
    codec: Codec
    ratio: float | None = None
    sets: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"codec": self.codec.codec_id, "params": self.codec.params,
                               "key": codec_key(self.codec), "ratio": _r(self.ratio)}
        for name, vals in self.sets.items():
            out[f"ppl_{name}"] = _r(vals["ppl"])
            out[f"ppl_delta_pct_{name}"] = _r(vals["delta_pct"])
            out[f"top1_agreement_{name}"] = _r(vals["top1_agreement"])
            out[f"kl_{name}"] = _r(vals["kl"], 6)
        return out


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


@dataclass(slots=True)
class QualityReport:
    conditions: dict[str, Any]
    baseline: dict[str, float]
    codecs: list[CodecQuality]

    def as_dict(self) -> dict[str, Any]:
        return {"conditions": self.conditions, "baseline_ppl": {k: _r(v) for k, v in self.baseline.items()},
                "codecs": {q.codec.codec_id if _unique(self.codecs, q) else codec_key(q.codec): q.as_dict()
                           for q in self.codecs}}


def _unique(all_q: list[CodecQuality], q: CodecQuality) -> bool:
    return sum(1 for o in all_q if o.codec.codec_id == q.codec.codec_id) == 1


def _score(logits: torch.Tensor, ids: torch.Tensor, base_logp: torch.Tensor | None
           ) -> tuple[float, int, float, torch.Tensor]:
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp.gather(1, ids[1:, None]).sum().item()
    if base_logp is None:
        return nll, 0, 0.0, logp
    agree = int((logp.argmax(-1) == base_logp.argmax(-1)).sum().item())
    kl = float((base_logp.exp() * (base_logp - logp)).sum().item())
    return nll, agree, kl, logp


def evaluate(model: Any, tokenizer: Any, codecs: Sequence[Codec], opts: QualityOptions = QualityOptions(),
             model_id: str = "") -> QualityReport:
    """Baseline and every codec on the same windows (the baseline forward is shared)."""
    attention.install(model)
    base: dict[str, _Acc] = {}
    accs: list[dict[str, _Acc]] = [{} for _ in codecs]
    hooks = [attention.KVHook(c, opts.kv_dtype) for c in codecs]
    with torch.inference_mode():
        for name in opts.sets:
            base[name] = _Acc()
            for a in accs:
                a[name] = _Acc()
            for ids in windows(tokenizer, name, opts.tokens, opts.windows):
                attention.set_hook(model, None)
                nll, _, _, base_logp = _score(model(ids[None], use_cache=False).logits[0], ids, None)
                base[name].add(nll, 0, 0.0, ids.numel() - 1)
                for hook, a in zip(hooks, accs, strict=True):
                    attention.set_hook(model, hook)
                    try:
                        nll, agree, kl, _ = _score(model(ids[None], use_cache=False).logits[0], ids, base_logp)
                    finally:
                        attention.set_hook(model, None)
                    a[name].add(nll, agree, kl, ids.numel() - 1)
                del base_logp
    baseline = {name: math.exp(acc.nll / acc.n) for name, acc in base.items()}
    results: list[CodecQuality] = []
    for codec, hook, a in zip(codecs, hooks, accs, strict=True):
        q = CodecQuality(codec, hook.ratio)
        for name, acc in a.items():
            ppl = math.exp(acc.nll / acc.n)
            q.sets[name] = {"ppl": ppl, "delta_pct": 100.0 * (ppl / baseline[name] - 1.0),
                            "top1_agreement": acc.agree / acc.n, "kl": acc.kl / acc.n}
        results.append(q)
    cond = {"model": model_id or getattr(getattr(model, "config", None), "_name_or_path", "unknown"),
            "model_dtype": "fp32", "kv_dtype": opts.kv_dtype.value, "tokens_per_window": opts.tokens,
            "windows_per_set": opts.windows, "text_sets": list(opts.sets), "python": sys.version.split()[0],
            "method": "K after RoPE and V encoded+decoded at every attention call, every token of the window",
            "torch_threads": torch.get_num_threads()}
    return QualityReport(cond, baseline, results)

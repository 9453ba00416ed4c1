"""What the simulator simulates: engines, their compute, links, tiers, codec, SLO. Pure data, checked.

A :class:`Deployment` is either disaggregated (``mode="pd"``: ``prefill`` engines compute prompts and
hand their KV over a link to ``decode`` engines) or colocated (``mode="colocated"``: ``prefill``
engines do both, chunked prefill beside the running decodes, the way vLLM v1 schedules). Compute is
a :class:`Compute`: the roofline of an accelerator (:mod:`kvport.planner.roofline`) or a model fitted
to measurements on this machine (:class:`FittedCompute`); it says which in ``basis``.

Every number is checked where it enters: a zero link, a zero-capacity tier, no engines, an SLO of 0
are :class:`~kvport.errors.SimInputError` naming the field, never a default put in their place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from kvport.errors import SimInputError
from kvport.spec import KVSpec
from kvport.store.eviction import DEFAULT_POLICY, POLICIES


class Compute(Protocol):
    """An engine's speed: a prefill of tokens [cached, tokens) and one decode step of a batch."""

    @property
    def basis(self) -> str: ...

    def prefill_seconds(self, cached: int, tokens: int) -> float: ...

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float: ...


def positive(name: str, v: object, *, zero_ok: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 \
            or (v == 0 and not zero_ok):
        raise SimInputError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0, got {v!r}")
    return float(v)


MAX_ENGINES = 4096  # of each role: a deployment larger than this is a typo, not a plan


def count(name: str, v: object, lo: int = 1, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise SimInputError(f"{name} must be an integer >= {lo}{f' and <= {hi}' if hi else ''}, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class FittedCompute:
    """Measured on a machine: a prefill model with ``seconds(start, end)`` (the planner's
    :class:`~kvport.planner.PrefillModel` fits) and a decode step ``a + b batch + c context_tokens``."""

    prefill: object  # anything with seconds(start, end) -> float
    step_a: float
    step_b: float = 0.0
    step_c: float = 0.0
    label: str = "fitted"

    def __post_init__(self) -> None:
        if not callable(getattr(self.prefill, "seconds", None)):
            raise SimInputError("FittedCompute.prefill must have seconds(start, end)")
        positive("decode step_a", self.step_a)
        positive("decode step_b", self.step_b, zero_ok=True)
        positive("decode step_c", self.step_c, zero_ok=True)

    @property
    def basis(self) -> str:
        return self.label

    def prefill_seconds(self, cached: int, tokens: int) -> float:
        return float(self.prefill.seconds(cached, tokens))  # type: ignore[attr-defined]

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        return self.step_a + self.step_b * batch + self.step_c * context_tokens


@dataclass(frozen=True, slots=True)
class LinearPrefill:
    """``a + b (end - start)`` seconds: an engine's prefill fitted from a few measured requests."""

    a: float
    b: float

    def __post_init__(self) -> None:
        positive("prefill a", self.a, zero_ok=True)
        positive("prefill b", self.b, zero_ok=True)

    def seconds(self, start: int, end: int) -> float:
        return 0.0 if end <= start else self.a + self.b * (end - start)


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A path bytes take: ``latency + bytes / bandwidth``, one transfer at a time (FIFO)."""

    bandwidth: float  # bytes/s
    latency: float = 0.0  # s

    def __post_init__(self) -> None:
        positive("link bandwidth", self.bandwidth)
        positive("link latency", self.latency, zero_ok=True)

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A cache level below the engine's own memory. ``scope="engine"``: one per prefill engine (its host
    RAM, its disk); ``"shared"``: one pool for all (Mooncake's store, ``kvport serve``, Redis).
    ``read`` is the path a hit takes into the engine; every prefill writes its blocks behind to the
    shared tiers (``write_through``) and evictions from above are demoted into the next tier down."""

    name: str
    capacity_bytes: int
    read: LinkSpec
    scope: str = "engine"
    policy: str = DEFAULT_POLICY
    write_through: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise SimInputError("a tier needs a name")
        count(f"tier {self.name}: capacity_bytes", self.capacity_bytes)
        if self.scope not in ("engine", "shared"):
            raise SimInputError(f"tier {self.name}: scope must be 'engine' or 'shared', got {self.scope!r}")
        if self.policy not in POLICIES:
            raise SimInputError(f"tier {self.name}: policy must be one of {', '.join(sorted(POLICIES))}, "
                                f"got {self.policy!r}")


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """A link codec: ``ratio`` fewer bytes on the hand-off link, at ``encode_bps``/``decode_bps``."""

    name: str
    ratio: float
    encode_bps: float
    decode_bps: float

    def __post_init__(self) -> None:
        positive(f"codec {self.name}: ratio", self.ratio)
        positive(f"codec {self.name}: encode_bps", self.encode_bps)
        positive(f"codec {self.name}: decode_bps", self.decode_bps)


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # DistServe: goodput counts a rate only while >= 90% meet both

    def __post_init__(self) -> None:
        positive("slo ttft_s", self.ttft_s)
        positive("slo tpot_s", self.tpot_s)
        if not 0 < self.attainment <= 1:
            raise SimInputError(f"slo attainment must be in (0, 1], got {self.attainment!r}")


@dataclass(frozen=True, slots=True)
class Deployment:
    spec: KVSpec  # the model's KV (bytes per token on links and in tiers)
    prefill_compute: Compute
    decode_compute: Compute
    prefill: int = 1  # engines (colocated: all of them)
    decode: int = 1  # pd only
    mode: str = "pd"
    link: LinkSpec = field(default_factory=lambda: LinkSpec(25e9))  # prefill -> decode, per decode engine
    tiers: tuple[TierSpec, ...] = ()
    device_cache_tokens: int = 0  # each prefill engine's prefix cache in its own memory (0: none)
    decode_kv_tokens: int = 1 << 20  # KV tokens a decode engine holds (its admission limit); colocated: the
    #                                   engine's KV room, shared with its prefix cache (``device_cache_tokens``)
    max_batch: int = 256  # running requests per decode engine
    chunk_tokens: int = 2048  # colocated: prefill tokens per step beside the decodes
    stream: str = "layerwise"  # hand-off overlapped with the prefill, layer by layer; or "after"
    hold: int = 2  # pd: finished prefills a prefill engine may hold for a full decode before it stops
    codec: CodecSpec | None = None
    block_tokens: int = 512  # tokens per trace block (Mooncake's traces: 512)
    planner: bool = True  # per request: load the cached prefix or recompute, whichever is faster
    first_token: str = "decode"  # pd: which engine yields the first token ("prefill": the demo's workers)
    overhead_s: float = 0.0  # per request before its first token (HTTP hops, tokenizer, scheduler), assumed
    handoff_window_bytes: int = 0  # >0: the receiver's credit window: a layer-wise stream gets at most this far
    #                               ahead of a decode engine that has no batch slot free for it, and the
    #                               prefill's last layer waits for the rest (the producer slows down)
    window_waits_for_slot: bool = True  # the receiver drains its window only once a batch slot is free (an
    #                                    engine's connector); False: it drains at the link's rate meanwhile
    #                                    (the demo's decode worker receives on a thread of its own)
    handoff_block_tokens: int = 0  # >0: only whole blocks of this size are handed over; the decode engine
    #                               computes the rest (at least the last token) in the step it joins
    slo: SLO = field(default_factory=lambda: SLO(2.0, 0.1))

    def __post_init__(self) -> None:
        count("prefill engines", self.prefill, 1, MAX_ENGINES)
        if self.mode not in ("pd", "colocated"):
            raise SimInputError(f"mode must be 'pd' or 'colocated', got {self.mode!r}")
        if self.mode == "pd":
            count("decode engines", self.decode, 1, MAX_ENGINES)
        count("device_cache_tokens", self.device_cache_tokens, 0)
        count("block_tokens", self.block_tokens)
        if 0 < self.device_cache_tokens < self.block_tokens:
            raise SimInputError(f"device_cache_tokens {self.device_cache_tokens} holds no block of {self.block_tokens} "
                                "tokens (0: no device cache)")
        count("decode_kv_tokens", self.decode_kv_tokens)
        if self.mode == "colocated" and self.engine_kv_tokens < 1:
            raise SimInputError(f"colocated: decode_kv_tokens {self.decode_kv_tokens} leaves nothing beside the "
                                f"device cache of {self.device_cache_tokens} tokens (they share one device's memory)")
        count("max_batch", self.max_batch)
        count("chunk_tokens", self.chunk_tokens)
        count("hold", self.hold)
        count("handoff_block_tokens", self.handoff_block_tokens, 0)
        count("handoff_window_bytes", self.handoff_window_bytes, 0)
        if self.first_token not in ("decode", "prefill"):
            raise SimInputError(f"first_token must be 'decode' or 'prefill', got {self.first_token!r}")
        positive("overhead_s", self.overhead_s, zero_ok=True)
        if self.stream not in ("layerwise", "after"):
            raise SimInputError(f"stream must be 'layerwise' or 'after', got {self.stream!r}")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names) or "device" in names:
            raise SimInputError(f"tier names must differ and not be 'device' (the engine's own), got {names}")
        scopes = [t.scope for t in self.tiers]
        if "shared" in scopes and "engine" in scopes[scopes.index("shared"):]:
            raise SimInputError(f"tiers {names}: every engine tier must come before the shared ones (evictions "
                                "are demoted down the list, and a shared pool keeps its own)")
        for t in self.tiers:
            if t.capacity_bytes < self.block_bytes:
                raise SimInputError(f"tier {t.name}: capacity_bytes {t.capacity_bytes} holds no block of "
                                    f"{self.block_bytes} bytes ({self.block_tokens} tokens of {self.spec.model_id})")

    @property
    def block_bytes(self) -> int:
        return self.spec.request_bytes(self.block_tokens)

    @property
    def engine_kv_tokens(self) -> int:
        """KV tokens of running requests an engine that decodes may hold: all of ``decode_kv_tokens`` on a
        decode engine; on a colocated one, what its prefix cache leaves of the same memory."""
        return self.decode_kv_tokens - (self.device_cache_tokens if self.mode == "colocated" else 0)

    def handoff_tokens(self, prompt: int) -> int:
        """Tokens whose KV a hand-off moves: the whole prompt, or its whole blocks (``handoff_block_tokens``)."""
        hb = self.handoff_block_tokens
        return prompt if not hb else hb * ((prompt - 1) // hb)

    @property
    def devices(self) -> int:
        return self.prefill + (self.decode if self.mode == "pd" else 0)

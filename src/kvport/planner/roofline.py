"""The roofline: prefill and decode times of a model on an accelerator from FLOPs and bytes alone.

A step takes the longer of its compute and its memory traffic. For tokens ``[s, e)`` computed with
``s`` tokens' KV already cached (``q = e - s``), ``L`` layers, ``H`` attention heads of widths
``d_qk`` and ``d_v`` (``A = 2 L H (d_qk + d_v)``, ``4 L H d`` for GQA), ``V`` vocab, ``h`` hidden,
``W`` weight bytes, ``kv(n)`` the KV bytes of ``n`` tokens (:class:`kvport.spec.KVSpec`), all per
device of a tensor-parallel group of ``tp``::

    prefill FLOPs   2 linear_params q + 2 V h + A q (s + (q + 1) / 2)
                    (matmuls of every new token; logits of the last token only; causal QK^T and AV:
                    new token j attends to s + j + 1 keys)
    prefill time    max(FLOPs / (peak(dtype) * prefill_efficiency * tp),
                        (W / tp + kv(e)) / (memory_bandwidth * decode_bandwidth_efficiency)) + AR(q)
    decode step     max((W_read(batch) / tp + kv(context)) / (memory_bandwidth * decode_bandwidth_efficiency),
                        (2 active_params batch + A context) / (peak(dtype) * prefill_efficiency * tp)) + AR(batch)
    AR(n)           2 L * 2 (tp - 1) / tp * n h itemsize / (interconnect / 2)   (0 at tp 1)

``context`` is the KV tokens the whole batch reads. ``W_read`` is all weights for a dense model; for a
MoE model, the routed experts a batch touches under uniform routing: each of ``E`` experts is missed
by all ``batch`` tokens with probability ``(1 - k/E)^batch``.

Assumptions, stated as such (override them with ``--efficiency`` or a calibration):

- ``prefill_efficiency`` 0.5: the fraction of peak dense FLOP/s a prefill reaches (its MFU).
  FlashAttention-2/3 and vLLM prefills of 8B-70B models on H100 run at 40-60% MFU; short prompts
  less. The same fraction caps a decode step's compute (which is rarely the bound).
- ``decode_bandwidth_efficiency`` 0.8: the fraction of the data sheet's memory bandwidth a step
  streams at (STREAM-like copies reach 80-90% of HBM peak).
- A TP group's all-reduces are added, not overlapped (:meth:`Roofline.allreduce_seconds`: ring, two
  per layer, half the bidirectional interconnect each way); kernel launches and the scheduler are not
  counted; the roofline is a lower bound on time that a calibration (:mod:`kvport.planner.calibrate`) replaces
  where one exists: on this machine's CPU (``--device cpu``), a profile's prefill model for the same
  model wins over the measured roofline, and the answer says which ``basis`` it used.

:meth:`Roofline.prefill_model` wraps the roofline as the cost model's
:class:`~kvport.planner.profile.PrefillModel`, so ``evaluate`` and ``crossover`` run unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvport.errors import ConfigError, ModelTooLargeError, PlanInputError, ProfileError
from kvport.planner.arch import ModelArch
from kvport.planner.devices import Accelerator
from kvport.planner.profile import PrefillModel
from kvport.spec import DType, KVSpec
from kvport.units import format_bytes

DEFAULT_PREFILL_EFFICIENCY = 0.5
DEFAULT_DECODE_BANDWIDTH_EFFICIENCY = 0.8
DEFAULT_MEMORY_FRACTION = 0.9  # vLLM's gpu_memory_utilization default


def check_fraction(name: str, v: object) -> float:
    """A number in (0, 1]; ConfigError naming ``name`` otherwise."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 < v <= 1:
        raise ConfigError(f"{name} must be a fraction in (0, 1], got {v!r}")
    return float(v)


@dataclass(frozen=True, slots=True)
class RooflineEstimate:
    seconds: float
    flops: float  # of the whole TP group
    bytes_per_device: float  # weights and KV each device reads or writes
    compute_bound: bool
    basis: str  # "roofline (h100, efficiency 0.5)"


@dataclass(frozen=True, slots=True)
class Roofline:
    """Times of ``arch`` in ``dtype`` (weights and matmuls) on ``tp`` devices like ``accelerator``.

    ``dtype`` and ``kv_dtype`` (the KV cache's element type; None: the model's) are kept by their
    canonical names (``bfloat16`` -> ``bf16``); see the module docstring for
    the formulas and for why the efficiencies default to 0.5 and 0.8."""

    arch: ModelArch
    accelerator: Accelerator
    dtype: str
    prefill_efficiency: float = DEFAULT_PREFILL_EFFICIENCY
    decode_bandwidth_efficiency: float = DEFAULT_DECODE_BANDWIDTH_EFFICIENCY
    tp: int = 1
    kv_dtype: str | None = None
    # derived once (a simulator asks for hundreds of thousands of decode steps): kv spec, rates, sizes
    _kv: KVSpec | None = field(default=None, init=False, repr=False, compare=False)
    _rates: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_fraction("prefill_efficiency", self.prefill_efficiency)
        check_fraction("decode_bandwidth_efficiency", self.decode_bandwidth_efficiency)
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"tp must be an integer >= 1, got {self.tp!r}")
        object.__setattr__(self, "dtype", DType.parse(self.dtype).value)  # "bfloat16" -> "bf16"
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", DType.parse(self.kv_dtype).value)
        self.accelerator.peak_flops(self.dtype)  # DeviceDTypeError now, not at first use
        dt = self.arch.kv.dtype if self.kv_dtype is None else DType.parse(self.kv_dtype)
        kv = self.arch.kv.with_(dtype=dt, tp_size=self.tp, tp_rank=0)  # SpecError now for a bad tp
        object.__setattr__(self, "_kv", kv)
        compute = self.accelerator.peak_flops(self.dtype) * self.prefill_efficiency * self.tp
        weights = self.arch.total_params * DType.parse(self.dtype).itemsize / self.tp
        memory = self.accelerator.memory_bandwidth * self.decode_bandwidth_efficiency
        object.__setattr__(self, "_rates", (compute, memory, weights, float(kv.bytes_per_token),
                                            2.0 * self.arch.active_params,
                                            2.0 * self.arch.num_layers * self.arch.attention_width))

    # ------------------------------------------------------------------ rates and sizes
    @property
    def basis(self) -> str:
        return f"roofline ({self.accelerator.name}, efficiency {self.prefill_efficiency:g})"

    @property
    def kv_spec(self) -> KVSpec:
        """One device's KV spec: the model's, in ``kv_dtype``, at ``tp``."""
        assert self._kv is not None  # set by __post_init__
        return self._kv

    @property
    def compute_rate(self) -> float:
        """FLOP/s the TP group reaches: peak * prefill_efficiency * tp."""
        return self._rates[0]

    @property
    def memory_rate(self) -> float:
        """Bytes/s one device streams: memory bandwidth * decode_bandwidth_efficiency."""
        return self._rates[1]

    @property
    def weight_bytes(self) -> float:
        """All weights of the model in ``dtype`` (total parameters * itemsize), over the whole group."""
        return self.arch.total_params * DType.parse(self.dtype).itemsize

    @property
    def weight_bytes_per_device(self) -> float:
        return self.weight_bytes / self.tp

    def kv_capacity_tokens(self, memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
        """Tokens of KV that fit on each device next to its weights (:func:`fit_on_device`)."""
        return fit_on_device(self.arch, self.accelerator, self.dtype, self.kv_spec, memory_fraction).tokens

    # ------------------------------------------------------------------ prefill
    def _attention(self) -> float:
        """``A``: FLOPs per (query, key) pair over all layers."""
        return 2.0 * self.arch.num_layers * self.arch.attention_width

    def prefill_flops(self, cached: int, tokens: int) -> float:
        """FLOPs of computing tokens ``[cached, tokens)`` with ``cached`` tokens' KV present."""
        _check_range(cached, tokens)
        q = tokens - cached
        if q == 0:
            return 0.0
        a = self.arch
        return 2.0 * a.linear_params * q + 2.0 * a.lm_head_params + self._attention() * q * (cached + (q + 1) / 2)

    def allreduce_seconds(self, tokens: int) -> float:
        """The TP group's all-reduces for ``tokens`` rows: two per layer (after attention, after the MLP)
        of ``tokens x hidden`` activations, ring algorithm: each device sends and receives
        ``2 (tp - 1) / tp`` of the bytes at half the data sheet's bidirectional interconnect figure.
        Not overlapped with the compute (vLLM's default); 0 at tp 1."""
        if self.tp == 1 or tokens <= 0:
            return 0.0
        nbytes = tokens * self.arch.hidden_size * DType.parse(self.dtype).itemsize
        per = 2.0 * (self.tp - 1) / self.tp * nbytes / (self.accelerator.interconnect / 2)
        return 2 * self.arch.num_layers * per

    def prefill(self, cached: int, tokens: int) -> RooflineEstimate:
        flops = self.prefill_flops(cached, tokens)
        nbytes = self.weight_bytes_per_device + self.kv_spec.request_bytes(tokens) if tokens > cached else 0.0
        compute, memory = flops / self.compute_rate, nbytes / self.memory_rate
        comm = self.allreduce_seconds(tokens - cached)
        return RooflineEstimate(max(compute, memory) + comm, flops, nbytes, compute >= memory, self.basis)

    def prefill_seconds(self, cached: int, tokens: int) -> float:
        return self.prefill(cached, tokens).seconds

    # ------------------------------------------------------------------ decode
    def decode_weight_bytes_per_device(self, batch: int) -> float:
        """Weights one decode step of ``batch`` sequences reads per device (MoE: the touched experts)."""
        a = self.arch
        if not a.experts:
            return self.weight_bytes_per_device
        missed = (1.0 - a.experts_per_token / a.experts) ** batch
        return (a.total_params - a.routed_expert_params * missed) * DType.parse(self.dtype).itemsize / self.tp

    def decode_step(self, batch: int, context_tokens: int) -> RooflineEstimate:
        """One decode step of ``batch`` sequences whose KV totals ``context_tokens`` tokens."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise PlanInputError(f"batch must be an integer >= 1, got {batch!r}")
        if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 0:
            raise PlanInputError(f"context_tokens must be an integer >= 0, got {context_tokens!r}")
        nbytes = self.decode_weight_bytes_per_device(batch) + self.kv_spec.request_bytes(context_tokens)
        flops = 2.0 * self.arch.active_params * batch + self._attention() * context_tokens
        compute, memory = flops / self.compute_rate, nbytes / self.memory_rate
        return RooflineEstimate(max(compute, memory) + self.allreduce_seconds(batch), flops, nbytes,
                                compute >= memory, self.basis)

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        """``decode_step(...).seconds``, without building the estimate (a dense model's hot path)."""
        if self.arch.experts or type(batch) is not int or type(context_tokens) is not int or batch < 1 \
                or context_tokens < 0:  # the checked path: MoE, or an argument it refuses
            return self.decode_step(batch, context_tokens).seconds
        compute, memory, weights, kv_token, active2, attn = self._rates
        return max((weights + kv_token * context_tokens) / memory,
                   (active2 * batch + attn * context_tokens) / compute) + self.allreduce_seconds(batch)

    # ------------------------------------------------------------------ for the cost model
    def prefill_model(self, now: float) -> RooflinePrefill:
        """This roofline as the cost model's prefill model, ``measured_at`` now. Its a, b, c, d are the
        compute-bound part (``t = FLOPs / compute_rate`` is that polynomial in q and s); its time is the
        roofline's, memory floor included."""
        r, big_a, a = self.compute_rate, self._attention(), self.arch
        return RooflinePrefill(model_id=a.model_id, threads=0, a=2.0 * a.lm_head_params / r,
                               b=(2.0 * a.linear_params + big_a / 2) / r, c=big_a / 2 / r, d=big_a / r,
                               measured_at=now, roofline=self)

    def as_dict(self) -> dict[str, object]:
        return {"basis": self.basis, "calibrated": False, "device": self.accelerator.as_dict(),
                "dtype": self.dtype, "kv_dtype": self.kv_spec.dtype.value, "tp": self.tp,
                "prefill_efficiency": self.prefill_efficiency,
                "decode_bandwidth_efficiency": self.decode_bandwidth_efficiency,
                "weight_bytes_per_device": self.weight_bytes_per_device,
                "total_params": self.arch.total_params, "active_params": self.arch.active_params}


@dataclass(frozen=True, slots=True)
class RooflinePrefill(PrefillModel):
    """A :class:`PrefillModel` whose time is its roofline's (``scale`` still applies, so live
    observations correct it as they correct a calibration). Never written to a profile file: only
    the compute polynomial a, b, c, d would survive it."""

    roofline: Roofline | None = None

    def __post_init__(self) -> None:
        PrefillModel.__post_init__(self)
        if self.roofline is None:
            raise ProfileError("a roofline prefill model needs its roofline")

    @property
    def model(self) -> Roofline:
        if self.roofline is None:  # not reached: __post_init__ refuses it
            raise ProfileError("a roofline prefill model needs its roofline")
        return self.roofline

    @property
    def basis(self) -> str:
        return self.model.basis

    def raw_seconds(self, start: int, end: int) -> float:
        return self.model.prefill_seconds(start, end) if end > start else 0.0


@dataclass(frozen=True, slots=True)
class DeviceFit:
    """A model on one device of a TP group: ``tokens`` of KV fit in what the weights leave of
    ``memory_fraction`` of the device's memory (``kv_budget_bytes``)."""

    model_id: str
    device: Accelerator
    weights_dtype: str
    tp: int
    weight_bytes_per_device: float
    memory_fraction: float
    kv_budget_bytes: float
    bytes_per_token: int  # KV of one token on one device
    tokens: int


def fit_on_device(arch: ModelArch, device: Accelerator, weights_dtype: str, kv: KVSpec,
                  memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> DeviceFit:
    """``arch``'s weights in ``weights_dtype`` split over ``kv.tp_size`` devices, and the tokens of KV
    (sized by ``kv``, one device's spec) that fit beside them. Needs no FLOP/s: any dtype sizes.
    ModelTooLargeError, naming the model, the device and both sizes, when not one token fits."""
    check_fraction("memory_fraction", memory_fraction)
    dt = DType.parse(weights_dtype)
    weights = arch.total_params * dt.itemsize / kv.tp_size
    usable = device.memory_bytes * memory_fraction
    budget = usable - weights
    if budget < kv.bytes_per_token:
        raise ModelTooLargeError(
            f"{arch.model_id} ({dt.value}, tp={kv.tp_size}) does not fit on {device.name}: "
            f"{format_bytes(weights)} of weights per device, {format_bytes(usable)} usable "
            f"({memory_fraction:g} of {format_bytes(device.memory_bytes)}), leaving no room for one token's KV "
            f"({format_bytes(kv.bytes_per_token)}); try a larger --tp")
    return DeviceFit(arch.model_id, device, dt.value, kv.tp_size, weights, memory_fraction, budget,
                     kv.bytes_per_token, int(budget // kv.bytes_per_token))


def _check_range(cached: int, tokens: int) -> None:
    for name, v in (("cached", cached), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanInputError(f"{name} must be an integer >= 0, got {v!r}")
    if cached > tokens:
        raise PlanInputError(f"cached ({cached}) must not exceed tokens ({tokens})")

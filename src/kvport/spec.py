"""KVSpec: the one description of a model's KV cache that every size in kvport is derived from.

A spec describes the KV held by *one tensor-parallel rank*. With ``tp_size > 1`` the KV heads are
split across ranks (``kv_heads_per_rank = num_kv_heads // tp_size``); when there are fewer KV heads
than ranks, each rank holds one replicated head, as vLLM does. Latent (MLA-style) caches store one
tensor of width ``head_dim`` per token and layer instead of K and V, and are replicated on every rank.

Sizes::

    bytes_per_token_layer = kv_factor * kv_heads_per_rank * head_dim * dtype.itemsize   (kv_factor 2, or 1 if latent)
    bytes_per_token       = num_layers * bytes_per_token_layer
    bytes_per_block       = block_size * bytes_per_token
    bytes_per_block_layer = block_size * bytes_per_token_layer
    request_bytes(n)      = n * bytes_per_token

kvport's canonical in-memory layout of one block (``Layout.LKHTD``)::

    [layer 0: K[head 0][token 0..T-1][dim 0..D-1] ... K[head H-1] | V[head 0] ... V[head H-1]]
    [layer 1: ...]
    ...

so one layer of one block is a contiguous ``bytes_per_block_layer`` slice and layer-wise streaming
sends whole slices.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from kvport.errors import SpecError, UnknownModelError


class DType(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"

    @property
    def itemsize(self) -> int:
        return {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}[self.value]

    @property
    def torch_name(self) -> str:
        return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}[self.value]

    @classmethod
    def parse(cls, text: str) -> DType:
        t = str(text).lower().replace("torch.", "")
        aliases = {
            "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
            "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
            "bf16": "bf16", "bfloat16": "bf16",
            "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "fp8_e4m3": "fp8",
        }
        if t not in aliases:
            raise SpecError(f"unknown dtype {text!r}: expected one of fp32, fp16, bf16, fp8")
        return cls(aliases[t])


class Layout(enum.Enum):
    """Memory layout of the KV as the engine holds it (compared for compatibility, never guessed)."""

    LKHTD = "lkhtd"  # kvport canonical: layer, K/V, head, token, dim (block-contiguous per layer)
    HF = "hf"  # transformers DynamicCache: per layer K and V tensors [batch, head, seq, dim]
    VLLM_CPU = "vllm_cpu"  # vLLM CPU backend: per layer [blocks, heads, block_size, 2*head_dim] (K rows, then V)
    VLLM_NHD = "vllm_nhd"  # vLLM GPU flash layout: [2, blocks, block_size, heads, dim]


@dataclass(frozen=True, slots=True)
class KVSpec:
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BF16
    block_size: int = 16
    revision: str = ""
    layout: Layout = Layout.LKHTD
    tp_rank: int = 0
    tp_size: int = 1
    latent: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise SpecError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if not self.model_id:
            raise SpecError("model_id must not be empty")
        if not self.latent and self.tp_size <= self.num_kv_heads and self.num_kv_heads % self.tp_size:
            raise SpecError(f"{self.num_kv_heads} KV heads cannot be split over tp_size={self.tp_size}")
        if not self.latent and self.tp_size > self.num_kv_heads and self.tp_size % self.num_kv_heads:
            raise SpecError(f"tp_size={self.tp_size} is not a multiple of {self.num_kv_heads} KV heads")

    # ------------------------------------------------------------------ derived sizes
    @property
    def kv_factor(self) -> int:
        """2 for separate K and V tensors, 1 for a latent (MLA) cache."""
        return 1 if self.latent else 2

    @property
    def kv_heads_per_rank(self) -> int:
        if self.latent:
            return self.num_kv_heads
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def head_range(self) -> tuple[int, int]:
        """``[lo, hi)``: the model's KV heads this rank holds. Split over ``tp_size`` ranks: rank r holds
        ``[r*n, (r+1)*n)`` with ``n = kv_heads_per_rank``; fewer heads than ranks: each head is replicated
        on ``tp_size // num_kv_heads`` neighbouring ranks, rank r holds head ``r // replicas``; latent
        (replicated on every rank): all heads."""
        if self.latent:
            return 0, self.num_kv_heads
        if self.tp_size > self.num_kv_heads:
            head = self.tp_rank // (self.tp_size // self.num_kv_heads)
            return head, head + 1
        lo = self.tp_rank * self.kv_heads_per_rank
        return lo, lo + self.kv_heads_per_rank

    @property
    def bytes_per_token_layer(self) -> int:
        return self.kv_factor * self.kv_heads_per_rank * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_layer

    @property
    def bytes_per_layer_block(self) -> int:
        return self.block_size * self.bytes_per_token_layer

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def request_bytes(self, tokens: int) -> int:
        if tokens < 0:
            raise SpecError(f"tokens must be >= 0, got {tokens}")
        return tokens * self.bytes_per_token

    def layer_bytes(self, tokens: int) -> int:
        """Bytes of one layer of ``tokens`` tokens."""
        return self.request_bytes(tokens) // self.num_layers

    def num_blocks(self, tokens: int, include_partial: bool = False) -> int:
        full, rest = divmod(tokens, self.block_size)
        return full + (1 if include_partial and rest else 0)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block in the canonical LKHTD layout: (layers, kv_factor, heads, tokens, dim)."""
        return (self.num_layers, self.kv_factor, self.kv_heads_per_rank, self.block_size, self.head_dim)

    # ------------------------------------------------------------------ identity
    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, enum.Enum) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVSpec:
        try:
            kw = dict(d)
            kw["dtype"] = DType.parse(kw.get("dtype", "bf16"))
            kw["layout"] = Layout(kw.get("layout", "lkhtd"))
            known = {f.name for f in fields(cls)}
            unknown = set(kw) - known
            if unknown:
                raise SpecError(f"unknown spec fields: {sorted(unknown)}")
            return cls(**kw)
        except (TypeError, ValueError) as exc:
            raise SpecError(f"invalid spec: {exc}") from exc

    @property
    def fingerprint(self) -> bytes:
        """16 bytes naming everything that makes two KV tensors interchangeable."""
        packed = msgpack.packb(sorted(self.as_dict().items()), use_bin_type=True)
        return xxhash.xxh3_128_digest(b"kvport.spec.v1\0" + packed)

    def first_mismatch(self, other: KVSpec, ignore: tuple[str, ...] = ()) -> tuple[str, Any, Any] | None:
        """The first field (in a fixed order, none of ``ignore``) where ``other`` differs from this
        spec, or None."""
        mine, theirs = self.as_dict(), other.as_dict()
        for name in COMPAT_FIELDS:
            if name not in ignore and mine[name] != theirs[name]:
                return name, mine[name], theirs[name]
        return None

    def with_(self, **changes: Any) -> KVSpec:
        return replace(self, **changes)

    def for_rank(self, rank: int, size: int) -> KVSpec:
        return replace(self, tp_rank=rank, tp_size=size)

    @property
    def whole(self) -> KVSpec:
        """This model's spec at tensor-parallel width 1 (every KV head): what block keys chain from
        (:func:`kvport.keys.head_keys` then names a rank's heads)."""
        return replace(self, tp_rank=0, tp_size=1)

    def heads(self, lo: int, hi: int) -> KVSpec:
        """The spec of the model's KV heads ``[lo, hi)`` alone (a piece of a re-shard between TP
        widths): the rank ``lo // w`` of ``num_kv_heads // w`` ranks, ``w = hi - lo``, so its block
        keys, sizes and envelope are those of a rank holding exactly these heads. A latent cache is
        replicated on every rank: its one piece is the whole (tp 1). SpecError for a range no TP
        width holds (not aligned to its width, or outside the model's heads)."""
        if self.latent:
            if (lo, hi) != (0, self.num_kv_heads):
                raise SpecError(f"a latent cache is replicated on every rank: heads [{lo}, {hi}) are not a piece")
            return replace(self, tp_rank=0, tp_size=1)
        n, w = self.num_kv_heads, hi - lo
        if not 0 <= lo < hi <= n or n % w or lo % w:
            raise SpecError(f"KV heads [{lo}, {hi}) of {n} are not what one rank of a TP width holds")
        return replace(self, tp_rank=lo // w, tp_size=n // w)

    def shared_heads(self, other: KVSpec) -> tuple[int, int] | None:
        """``[lo, hi)``: the KV heads both this rank and ``other`` (another rank of the same model,
        maybe of another TP width) hold, or None when they share none."""
        (a, b), (c, d) = self.head_range, other.head_range
        lo, hi = max(a, c), min(b, d)
        return (lo, hi) if lo < hi else None


TP_FIELDS: tuple[str, ...] = ("tp_size", "tp_rank")  # what a re-shard may change (heads, not bytes per head)

COMPAT_FIELDS: tuple[str, ...] = (
    "model_id", "revision", "dtype", "layout", "num_layers", "num_kv_heads", "head_dim",
    "block_size", "tp_size", "tp_rank", "latent",
)


# ---------------------------------------------------------------------- presets
@dataclass(frozen=True, slots=True)
class Preset:
    hf_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    latent: bool = False
    source: str = ""


# Values from each model's published config.json (num_hidden_layers, num_key_value_heads,
# head_dim or hidden_size / num_attention_heads, torch_dtype). DeepSeek-V3's MLA cache stores the
# compressed latent (kv_lora_rank 512) plus the decoupled RoPE key (qk_rope_head_dim 64) = 576 per token.
PRESETS: dict[str, Preset] = {
    "llama-3.1-8b": Preset("meta-llama/Llama-3.1-8B", 32, 8, 128, DType.BF16,
                           source="32 layers, 8 KV heads, 4096/32 = 128"),
    "llama-3.1-70b": Preset("meta-llama/Llama-3.1-70B", 80, 8, 128, DType.BF16,
                            source="80 layers, 8 KV heads, 8192/64 = 128"),
    "llama-3.2-1b": Preset("meta-llama/Llama-3.2-1B", 16, 8, 64, DType.BF16,
                           source="16 layers, 8 KV heads, head_dim 64"),
    "qwen2.5-7b": Preset("Qwen/Qwen2.5-7B", 28, 4, 128, DType.BF16,
                         source="28 layers, 4 KV heads, 3584/28 = 128"),
    "qwen3-8b": Preset("Qwen/Qwen3-8B", 36, 8, 128, DType.BF16,
                       source="36 layers, 8 KV heads, head_dim 128"),
    "mistral-7b": Preset("mistralai/Mistral-7B-v0.3", 32, 8, 128, DType.BF16,
                         source="32 layers, 8 KV heads, 4096/32 = 128"),
    "deepseek-v3": Preset("deepseek-ai/DeepSeek-V3", 61, 1, 576, DType.BF16, latent=True,
                          source="61 layers, MLA kv_lora_rank 512 + qk_rope_head_dim 64"),
    "smollm2-135m": Preset("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64, DType.BF16,
                           source="30 layers, 3 KV heads, 576/9 = 64"),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def from_preset(name: str, *, dtype: DType | str | None = None, block_size: int = 16,
                tp_rank: int = 0, tp_size: int = 1, layout: Layout = Layout.LKHTD) -> KVSpec:
    key = name.lower().strip()
    p = PRESETS.get(key)
    if p is None:  # accept the HF id too
        p = next((q for q in PRESETS.values() if q.hf_id.lower() == key), None)
    if p is None:
        raise UnknownModelError(f"unknown model {name!r}: expected one of {', '.join(preset_names())} "
                                "or a path to a config.json")
    dt = p.dtype if dtype is None else (dtype if isinstance(dtype, DType) else DType.parse(dtype))
    return KVSpec(model_id=p.hf_id, num_layers=p.num_layers, num_kv_heads=p.num_kv_heads,
                  head_dim=p.head_dim, dtype=dt, block_size=block_size, revision="preset",
                  layout=layout, tp_rank=tp_rank, tp_size=tp_size, latent=p.latent)


def _int_field(cfg: dict[str, Any], name: str) -> int:
    v = cfg.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise SpecError(f"config.json: {name} must be a positive integer, got {v!r}")
    return v


def from_hf_config(path: str | Path, *, dtype: DType | str | None = None, block_size: int = 16,
                   tp_rank: int = 0, tp_size: int = 1, layout: Layout = Layout.LKHTD,
                   model_id: str | None = None) -> KVSpec:
    """Build a spec from a HuggingFace ``config.json`` (a file or a folder that holds one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise UnknownModelError(f"cannot read {p}: {exc.strerror or exc}") from exc
    try:
        cfg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{p}: malformed config.json ({exc})") from exc
    if not isinstance(cfg, dict):
        raise SpecError(f"{p}: config.json must hold a JSON object")
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    layers = _int_field(cfg, "num_hidden_layers")
    latent = "kv_lora_rank" in cfg and cfg.get("kv_lora_rank") is not None
    if latent:
        head_dim = _int_field(cfg, "kv_lora_rank") + _int_field(cfg, "qk_rope_head_dim")
        kv_heads = 1
    else:
        heads = _int_field(cfg, "num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads <= 0:
            raise SpecError(f"config.json: num_key_value_heads must be a positive integer, got {kv_heads!r}")
        if cfg.get("head_dim"):
            head_dim = _int_field(cfg, "head_dim")
        else:
            hidden = _int_field(cfg, "hidden_size")
            if hidden % heads:
                raise SpecError(f"config.json: hidden_size {hidden} not divisible by {heads} heads")
            head_dim = hidden // heads
    if dtype is None:
        dt = DType.parse(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bf16"))
    else:
        dt = dtype if isinstance(dtype, DType) else DType.parse(dtype)
    name = model_id or str(cfg.get("_name_or_path") or p.parent.name or "local")
    revision = "cfg-" + xxhash.xxh3_64_hexdigest(raw)
    return KVSpec(model_id=name, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dt,
                  block_size=block_size, revision=revision, layout=layout, tp_rank=tp_rank,
                  tp_size=tp_size, latent=latent)


def resolve(model: str, **kw: Any) -> KVSpec:
    """A preset name / HF id, or a path to a config.json or a model folder."""
    p = Path(model)
    if p.suffix == ".json" or p.is_dir() or (p.exists() and p.is_file()):
        return from_hf_config(p, **kw)
    return from_preset(model, **kw)

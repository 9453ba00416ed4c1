"""ModelArch: what the roofline needs of a model beyond its KV cache, and its parameter counts.

The KV shape (layers, KV heads, head_dim, dtype) stays in :data:`kvport.spec.PRESETS`; this module
adds, per preset and from the same published config.json, the shapes that set FLOPs and weight
bytes (:data:`ARCHS`), and reads the same fields from any config.json, so that every model
:func:`kvport.spec.resolve` takes has an architecture too (:func:`model_arch`).

Parameters counted from the shapes (``h`` hidden, ``H`` attention heads, ``G`` KV heads, ``d``
head_dim, ``i`` intermediate, ``V`` vocab; biases left out: Qwen2.5's q/k/v biases are 0.06% of
its weights)::

    attention (GQA)  h*H*d (q) + 2*h*G*d (k, v) + H*d*h (o)
    attention (MLA)  q: h*r_q + r_q*H*(d_nope + d_rope)   (or h*H*(d_nope + d_rope) without q_lora_rank)
                     kv: h*(r_kv + d_rope) + r_kv*H*(d_nope + d_v),   o: H*d_v*h
    MLP (gated)      3*h*i per expert; a MoE layer has E routed + S shared experts and a router h*E,
                     a token runs k routed + S shared
    norms            2*h per layer + h at the end (+ MLA's r_q + r_kv)
    embeddings       V*h, and V*h again for an untied lm_head

A MoE preset's ``published_total`` / ``published_active`` (the model card's) win over the counts
from the shapes: the shapes count DeepSeek-V3 within 0.1%, but the card is the number people quote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvport.errors import SpecError, UnknownModelError
from kvport.spec import DType, KVSpec, resolve


@dataclass(frozen=True, slots=True)
class ModelArch:
    """A model's shapes. ``kv`` is its KV spec at tp 1 (layers, KV heads, KV dtype); ``qk_head_dim``
    and ``v_head_dim`` are the attention's per-head widths for FLOPs (equal to the KV head_dim for
    GQA; 192 and 128 for DeepSeek-V3's MLA, whose KV head_dim is the 576-wide latent)."""

    kv: KVSpec
    hidden_size: int
    num_attention_heads: int
    qk_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense MLP width (a MoE model's dense layers)
    vocab_size: int
    tie_word_embeddings: bool
    dtype: DType  # the weights' published dtype
    experts: int = 0  # routed experts per MoE layer; 0: dense
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in a MoE model (DeepSeek's first_k_dense_replace)
    q_lora_rank: int = 0  # MLA only (kv_lora_rank > 0)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    published_total: float | None = None
    published_active: float | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "qk_head_dim", "v_head_dim", "intermediate_size",
                     "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SpecError(f"{self.kv.model_id}: {name} must be a positive integer, got {v!r}")
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise SpecError(f"{self.kv.model_id}: experts_per_token must be in [1, {self.experts}], "
                            f"got {self.experts_per_token}")

    @property
    def model_id(self) -> str:
        return self.kv.model_id

    @property
    def num_layers(self) -> int:
        return self.kv.num_layers

    # ------------------------------------------------------------------ counts from the shapes
    def _attention_params(self) -> int:
        h, nh = self.hidden_size, self.num_attention_heads
        if self.kv_lora_rank:
            rq, rkv, rope = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim
            q = h * rq + rq * nh * self.qk_head_dim + rq if rq else h * nh * self.qk_head_dim
            kv = h * (rkv + rope) + rkv * nh * (self.qk_head_dim - rope + self.v_head_dim) + rkv
            return q + kv + nh * self.v_head_dim * h
        return h * nh * self.qk_head_dim + 2 * h * self.kv.num_kv_heads * self.qk_head_dim \
            + nh * self.v_head_dim * h

    def _mlp_params(self, *, active: bool) -> int:
        """All layers' MLP parameters; ``active``: those one token runs."""
        h, layers = self.hidden_size, self.num_layers
        if not self.experts:
            return layers * 3 * h * self.intermediate_size
        moe_layers = layers - self.dense_layers
        n = (self.experts_per_token if active else self.experts) + self.shared_experts
        per_moe = n * 3 * h * self.expert_intermediate_size + h * self.experts
        return self.dense_layers * 3 * h * self.intermediate_size + moe_layers * per_moe

    def _embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def counted_params(self, *, active: bool = False) -> int:
        """Parameters from the shapes (see the module docstring); ``active``: those one token runs."""
        h = self.hidden_size
        per_layer = self._attention_params() + 2 * h
        return self.num_layers * per_layer + self._mlp_params(active=active) + self._embedding_params() + h

    @property
    def total_params(self) -> float:
        """Weights held: the model card's for a MoE preset, else counted from the shapes."""
        return self.published_total if self.published_total is not None else float(self.counted_params())

    @property
    def active_params(self) -> float:
        """Weights one token runs: the model card's for a MoE preset, else counted (all, for a dense model)."""
        if self.published_active is not None:
            return self.published_active
        return float(self.counted_params(active=True))

    @property
    def routed_expert_params(self) -> int:
        """Parameters of all routed experts (0 for a dense model): what a decode step reads only in part."""
        if not self.experts:
            return 0
        return (self.num_layers - self.dense_layers) * self.experts * 3 * self.hidden_size * \
            self.expert_intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def linear_params(self) -> float:
        """Parameters of the matmuls every token runs: the active weights less the input embedding (a
        lookup) and the lm_head (logits only for the last token). Norms stay in: under 0.01%."""
        return self.active_params - self._embedding_params()

    @property
    def attention_width(self) -> int:
        """``H * (d_qk + d_v)``: FLOPs of attention per (query, key) pair and layer are twice this."""
        return self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)


def _arch(name: str, hidden: int, heads: int, inter: int, vocab: int, tied: bool, **kw: Any) -> ModelArch:
    kv = resolve(name)
    qk = kw.pop("qk_head_dim", kv.head_dim)
    return ModelArch(kv=kv, hidden_size=hidden, num_attention_heads=heads, qk_head_dim=qk,
                     v_head_dim=kw.pop("v_head_dim", qk), intermediate_size=inter, vocab_size=vocab,
                     tie_word_embeddings=tied, dtype=kv.dtype, **kw)


# From each model's published config.json (hidden_size, num_attention_heads, intermediate_size,
# vocab_size, tie_word_embeddings); layers, KV heads and head_dim from kvport.spec.PRESETS.
# DeepSeek-V3: MLA (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64 = 192, v 128),
# 256 routed + 1 shared experts of 2048, 8 per token, first 3 layers dense (18432); the model card's
# 671B total / 37B active (the 14B multi-token-prediction module of the 685B checkpoint left out).
ARCHS: dict[str, ModelArch] = {
    "llama-3.1-8b": _arch("llama-3.1-8b", 4096, 32, 14336, 128256, False),
    "llama-3.1-70b": _arch("llama-3.1-70b", 8192, 64, 28672, 128256, False),
    "llama-3.2-1b": _arch("llama-3.2-1b", 2048, 32, 8192, 128256, True),
    "qwen2.5-7b": _arch("qwen2.5-7b", 3584, 28, 18944, 152064, False),
    "qwen3-8b": _arch("qwen3-8b", 4096, 32, 12288, 151936, False),
    "mistral-7b": _arch("mistral-7b", 4096, 32, 14336, 32768, False),
    "deepseek-v3": _arch("deepseek-v3", 7168, 128, 18432, 129280, False, qk_head_dim=192, v_head_dim=128,
                         experts=256, experts_per_token=8, expert_intermediate_size=2048, shared_experts=1,
                         dense_layers=3, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                         published_total=671e9, published_active=37e9),
    "smollm2-135m": _arch("smollm2-135m", 576, 9, 1536, 49152, True),
}


def _int(cfg: dict[str, Any], name: str, default: int | None = None) -> int:
    v = cfg.get(name, default)
    if v is None and default is not None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SpecError(f"config.json: {name} must be a non-negative integer, got {v!r}")
    return v


def _from_config(path: Path, kv: KVSpec) -> ModelArch:
    p = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(p.read_text())
    except OSError as exc:
        raise UnknownModelError(f"cannot read {p}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{p}: malformed config.json ({exc})") from exc
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    mla = bool(cfg.get("kv_lora_rank"))
    rope = _int(cfg, "qk_rope_head_dim", 0) if mla else 0
    qk = _int(cfg, "qk_nope_head_dim") + rope if mla else kv.head_dim
    experts = _int(cfg, "n_routed_experts", 0) or _int(cfg, "num_local_experts", 0) or _int(cfg, "num_experts", 0)
    # Mixtral: experts as wide as intermediate_size; Qwen-MoE and DeepSeek: moe_intermediate_size
    expert_i = _int(cfg, "moe_intermediate_size", 0) or _int(cfg, "intermediate_size")
    shared = _int(cfg, "n_shared_experts", 0)
    if not shared and _int(cfg, "shared_expert_intermediate_size", 0):  # Qwen2-MoE: one shared expert of its own width
        shared = max(1, round(_int(cfg, "shared_expert_intermediate_size") / expert_i))
    return ModelArch(
        kv=kv, hidden_size=hidden, num_attention_heads=heads, qk_head_dim=qk,
        v_head_dim=_int(cfg, "v_head_dim") if mla else qk, intermediate_size=_int(cfg, "intermediate_size"),
        vocab_size=_int(cfg, "vocab_size"), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=kv.dtype, experts=experts, experts_per_token=_int(cfg, "num_experts_per_tok", 0) if experts else 0,
        expert_intermediate_size=expert_i if experts else 0, shared_experts=shared if experts else 0,
        dense_layers=_int(cfg, "first_k_dense_replace", 0) if experts else 0,
        q_lora_rank=_int(cfg, "q_lora_rank", 0) if mla else 0, kv_lora_rank=_int(cfg, "kv_lora_rank", 0),
        qk_rope_head_dim=rope)


def model_arch(model: str) -> ModelArch:
    """A preset name / HF id, or a config.json (file or folder), as :func:`kvport.spec.resolve` takes them."""
    kv = resolve(model)
    p = Path(model)
    if p.suffix == ".json" or p.is_dir() or p.is_file():
        return _from_config(p, kv)
    return next(a for a in ARCHS.values() if a.model_id == kv.model_id)

"""SGLang's real host KV pools and storage config, built on this CPU for kvport's backend tests.

Importing this puts tests/support/sglang_cpu on sys.path first (the ``sgl_kernel`` and torchvision
stand-ins SGLang imports at start-up; see docs/sglang.md), then imports SGLang.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SHIMS = Path(__file__).resolve().parents[1] / "support" / "sglang_cpu"
if str(SHIMS) not in sys.path:
    sys.path.insert(0, str(SHIMS))

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MLABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvport.deploy.sglang_bench import mha_host_pool  # noqa: E402
from kvport.spec import DType, KVSpec  # noqa: E402

BACKEND = {"backend_name": "kvport", "module_path": "kvport.engines.sglang.storage", "class_name": "KVPortStorage",
           "interface_v1": 1}
DEVICE_TOKENS = 256


def _ptrs(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def mha_pool(layout: str, *, layers: int = 30, heads: int = 3, dim: int = 64, page: int = 16) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (2x a 256-token device pool), filled with random KV."""
    spec = KVSpec("test", num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=DType.FP32, block_size=page)
    return mha_host_pool(spec, layout, DEVICE_TOKENS)


def mla_pool(layout: str, *, layers: int = 4, lora: int = 64, rope: int = 32, page: int = 16) -> MLATokenToKVPoolHost:
    bufs = tuple(torch.zeros(DEVICE_TOKENS, 1, lora + rope) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=_ptrs(list(bufs)), layer_indices=tuple(range(layers)),
                         device_layer_num=layers, page_size=page, kv_lora_rank=lora, qk_rope_head_dim=rope,
                         kv_cache_dim=lora + rope, dtype=torch.float32, device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=layers,
                                target_layer_num=layers)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    pool._keep = bufs
    return pool


def mla_model(root: Path, *, layers: int = 4, lora: int = 64, rope: int = 32) -> Path:
    """A model folder whose config is an MLA model's (DeepSeek-V2 style) and a small weights file."""
    d = root / "mla-model"
    d.mkdir(exist_ok=True)
    cfg = {"model_type": "deepseek_v2", "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 4, "hidden_size": 256, "kv_lora_rank": lora, "qk_rope_head_dim": rope,
           "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"\0" * 4096)
    return d


def storage_config(model: Path, extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   layout: str = "layer_first") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=str(model),
                                extra_config={**BACKEND, **extra})


def backend(pool: Any, model: Path, extra: dict[str, Any], **kw: Any) -> Any:
    """kvport's backend as SGLang makes it: the factory's ``dynamic`` path, then the pool registered
    (SGLang's cache controller does both, in this order)."""
    cfg = storage_config(model, extra, layout=pool.layout, **kw)
    be = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    be.register_mem_pool_host(pool)
    return be


def page_indices(first_page: int, pages: int, page: int = 16) -> torch.Tensor:
    return torch.arange(first_page * page, (first_page + pages) * page, dtype=torch.int64)


def names(n: int, salt: int = 0) -> list[str]:
    """SGLang-style page names: 64 hex characters."""
    return [f"{salt:08x}{i:056x}" for i in range(n)]

import json
from pathlib import Path

import pytest

from kvport.errors import IncompatibleSpecError, SpecError, UnknownModelError, UserInputError
from kvport.spec import PRESETS, DType, KVSpec, Layout, from_hf_config, from_preset, resolve


def test_source_documents_example_is_exactly_8_gib() -> None:
    spec = from_preset("llama-3.1-8b", dtype="fp16")
    assert spec.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    assert spec.request_bytes(65536) == 8 * 1024**3
    assert spec.request_bytes(65536) / (20 * 1024**3) == pytest.approx(0.4)


def test_derived_sizes_are_consistent() -> None:
    spec = from_preset("smollm2-135m", dtype="bf16", block_size=16)
    assert spec.bytes_per_token_layer == 2 * 3 * 64 * 2
    assert spec.bytes_per_token == 30 * spec.bytes_per_token_layer
    assert spec.bytes_per_block == 16 * spec.bytes_per_token
    assert spec.bytes_per_layer_block * spec.num_layers == spec.bytes_per_block
    assert spec.layer_bytes(2048) * 30 == spec.request_bytes(2048)
    assert spec.block_shape == (30, 2, 3, 16, 64)
    assert spec.num_blocks(100) == 6 and spec.num_blocks(100, include_partial=True) == 7


def test_tensor_parallel_splits_kv_heads() -> None:
    full = from_preset("llama-3.1-70b")
    tp4 = from_preset("llama-3.1-70b", tp_size=4, tp_rank=3)
    assert tp4.kv_heads_per_rank == 2
    assert tp4.bytes_per_token * 4 == full.bytes_per_token
    tp16 = from_preset("llama-3.1-70b", tp_size=16)  # more ranks than KV heads: one replicated head each
    assert tp16.kv_heads_per_rank == 1
    with pytest.raises(SpecError):
        from_preset("qwen2.5-7b", tp_size=3)


def test_head_range_is_the_kv_heads_a_rank_holds() -> None:
    assert from_preset("llama-3.1-70b").head_range == (0, 8)
    assert [from_preset("llama-3.1-70b", tp_size=4, tp_rank=r).head_range for r in range(4)] == \
        [(0, 2), (2, 4), (4, 6), (6, 8)]
    # more ranks than heads: each head on tp_size // heads neighbouring ranks (vLLM's replicas)
    assert [from_preset("llama-3.1-70b", tp_size=16, tp_rank=r).head_range for r in (0, 1, 2, 15)] == \
        [(0, 1), (0, 1), (1, 2), (7, 8)]
    assert from_preset("deepseek-v3", tp_size=8, tp_rank=5).head_range == (0, 1)  # latent: replicated
    spec = from_preset("smollm2-135m")
    assert spec.fingerprint == from_preset("smollm2-135m").fingerprint  # a property, not a field
    assert "head_range" not in spec.as_dict()


def test_mla_latent_cache_is_one_tensor_replicated_over_ranks() -> None:
    ds = from_preset("deepseek-v3")
    assert ds.latent and ds.kv_factor == 1
    assert ds.bytes_per_token == 61 * 576 * 2
    assert from_preset("deepseek-v3", tp_size=8).bytes_per_token == ds.bytes_per_token


def test_presets_match_published_configs() -> None:
    expected = {  # (layers, kv heads, head dim) from each model's config.json
        "llama-3.1-8b": (32, 8, 128), "llama-3.1-70b": (80, 8, 128), "qwen2.5-7b": (28, 4, 128),
        "mistral-7b": (32, 8, 128), "smollm2-135m": (30, 3, 64), "deepseek-v3": (61, 1, 576),
    }
    for name, (layers, heads, dim) in expected.items():
        p = PRESETS[name]
        assert (p.num_layers, p.num_kv_heads, p.head_dim) == (layers, heads, dim), name


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(UnknownModelError) as info:
        from_preset("gpt-9")
    assert "llama-3.1-8b" in str(info.value)
    assert isinstance(info.value, UserInputError)


def test_from_hf_config(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "torch_dtype": "bfloat16", "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = from_hf_config(tmp_path)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (30, 3, 64, DType.BF16)
    assert spec.revision.startswith("cfg-")
    assert resolve(str(tmp_path / "config.json")) == spec
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
    (tmp_path / "mla.json").write_text(json.dumps(mla))
    assert from_hf_config(tmp_path / "mla.json").bytes_per_token == from_preset("deepseek-v3").bytes_per_token


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"num_hidden_layers": -1}',
                                     '{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 10}'])
def test_malformed_config_is_a_spec_error(tmp_path: Path, content: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(SpecError):
        from_hf_config(tmp_path)


def test_missing_config_is_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError):
        from_hf_config(tmp_path / "nope.json")


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_sizes_rejected(field: str, value: int) -> None:
    kw = dict(model_id="m", num_layers=2, num_kv_heads=2, head_dim=8)
    kw[field] = value
    with pytest.raises(SpecError):
        KVSpec(**kw)  # type: ignore[arg-type]


def test_fingerprint_and_first_mismatch() -> None:
    a = from_preset("llama-3.1-8b")
    assert a.fingerprint == from_preset("llama-3.1-8b").fingerprint and len(a.fingerprint) == 16
    b = a.with_(dtype=DType.FP16)
    assert a.fingerprint != b.fingerprint
    assert a.first_mismatch(b) == ("dtype", "bf16", "fp16")
    assert a.first_mismatch(a.with_(layout=Layout.HF))[0] == "layout"
    assert a.first_mismatch(a.for_rank(1, 2))[0] == "tp_size"
    assert a.first_mismatch(a) is None
    err = IncompatibleSpecError("dtype", "bf16", "fp16")
    assert err.field == "dtype" and "dtype" in str(err)


def test_dict_round_trip() -> None:
    a = from_preset("deepseek-v3", block_size=64)
    assert KVSpec.from_dict(a.as_dict()) == a
    with pytest.raises(SpecError):
        KVSpec.from_dict({**a.as_dict(), "bogus": 1})

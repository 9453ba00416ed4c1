"""Accelerator presets, model shapes and the roofline: hand-computed cases, and ``--device`` on the CLI.

The expected numbers are written out from the published shapes (config.json) and data sheets, not
from the code under test: llama-3.1-8b has 32 layers of hidden 4096, 32 heads of 128, 8 KV heads,
MLP 14336, vocab 128256, untied; the H100 SXM is 989.4e12 dense bf16 FLOP/s, 3.35e12 B/s, 80e9 B.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from kvport.cli.main import main
from kvport.errors import (
    ConfigError,
    DeviceDTypeError,
    ModelTooLargeError,
    PlanInputError,
    UnknownDeviceError,
    UserInputError,
)
from kvport.planner import (
    ACCELERATORS,
    Accelerator,
    PrefillModel,
    Profile,
    Roofline,
    accelerator,
    device_names,
    machine_id,
    measure_cpu,
    model_arch,
)
from kvport.planner.arch import ARCHS
from kvport.planner.roofline import fit_on_device
from kvport.refmodel import MODEL_ID
from kvport.spec import PRESETS, from_preset

# llama-3.1-8b, counted by hand: per layer q 4096*4096, k and v 4096*1024 each, o 4096*4096, MLP 3*4096*14336,
# two norms of 4096; a final norm; embeddings and lm_head 128256*4096 each
LLAMA8_LAYER = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
LLAMA8_LINEAR = 32 * LLAMA8_LAYER + 4096  # 6,979,588,096: every matmul a token runs but the lm_head
LLAMA8_TOTAL = LLAMA8_LINEAR + 2 * 128256 * 4096  # 8,030,261,248 (the model card's 8.03B)
LLAMA8_WEIGHTS = 2 * LLAMA8_TOTAL  # bf16: 16,060,522,496 bytes
KV_PER_TOKEN = 2 * 8 * 128 * 2 * 32  # K and V, 8 heads of 128, bf16, 32 layers: 131,072 bytes
ATTN = 4 * 32 * 32 * 128  # FLOPs per (query, key) pair: QK^T and AV, 32 layers of 32 heads of 128


@pytest.fixture
def h100_8b() -> Roofline:
    return Roofline(model_arch("llama-3.1-8b"), accelerator("h100"), "bf16")


# ------------------------------------------------------------------ shapes and parameter counts
@pytest.mark.parametrize(("name", "published"), [
    ("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.6e9), ("llama-3.2-1b", 1.24e9), ("qwen2.5-7b", 7.61e9),
    ("qwen3-8b", 8.19e9), ("mistral-7b", 7.25e9), ("smollm2-135m", 134.5e6), ("deepseek-v3", 671e9),
])
def test_parameter_counts_from_the_shapes_are_within_2_percent_of_the_model_cards(name: str,
                                                                                  published: float) -> None:
    assert model_arch(name).counted_params() == pytest.approx(published, rel=0.02)


def test_exact_counts_of_the_dense_presets() -> None:
    assert model_arch("llama-3.1-8b").counted_params() == LLAMA8_TOTAL == 8_030_261_248
    assert model_arch("llama-3.1-8b").linear_params == LLAMA8_LINEAR
    assert model_arch("llama-3.2-1b").counted_params() == 1_235_814_400  # tied: one 128256 x 2048 matrix
    assert model_arch("smollm2-135m").counted_params() == 134_515_008


def test_moe_uses_the_model_cards_counts_and_its_shapes_agree() -> None:
    ds = model_arch("deepseek-v3")
    assert (ds.total_params, ds.active_params) == (671e9, 37e9)
    assert ds.counted_params(active=True) == pytest.approx(37e9, rel=0.02)
    assert ds.linear_params == 37e9 - 2 * 129280 * 7168
    assert ds.attention_width == 128 * (192 + 128)  # MLA: q.k over 128 nope + 64 rope dims, v of 128


def test_every_preset_has_an_architecture_and_an_hf_id_finds_it() -> None:
    assert set(ARCHS) == set(PRESETS)
    assert model_arch("meta-llama/Llama-3.1-8B") == model_arch("llama-3.1-8b")


def test_a_config_json_gives_the_same_architecture_as_the_preset(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = {"num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
           "hidden_size": 2048, "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = model_arch(str(tmp_path / "config.json"))
    assert arch.counted_params() == model_arch("llama-3.2-1b").counted_params()
    assert arch.attention_width == model_arch("llama-3.2-1b").attention_width


MIXTRAL = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
DEEPSEEK_V3 = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "vocab_size": 129280}


@pytest.mark.parametrize(("cfg", "total", "active"), [(MIXTRAL, 46.7e9, 12.9e9), (DEEPSEEK_V3, 671e9, 37e9)])
def test_moe_config_json_counts_total_and_active(cfg: dict[str, int], total: float, active: float,
                                                 tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    arch = model_arch(str(tmp_path))
    assert arch.total_params == pytest.approx(total, rel=0.02)
    assert arch.active_params == pytest.approx(active, rel=0.02)


# ------------------------------------------------------------------ devices
def test_presets_carry_the_data_sheet_numbers_and_a_source() -> None:
    h100, a100 = ACCELERATORS["h100"], ACCELERATORS["a100"]
    assert h100.peak_flops("bf16") == 989.4e12 and h100.peak_flops("fp8") == 1978.9e12
    assert (h100.memory_bandwidth, h100.memory_bytes, h100.interconnect) == (3.35e12, 80e9, 900e9)
    assert ACCELERATORS["h800"].interconnect == 400e9 and ACCELERATORS["h800"].peak_flops("bf16") == 989.4e12
    assert ACCELERATORS["h200"].memory_bandwidth == 4.8e12 and ACCELERATORS["h200"].memory_bytes == 141e9
    assert a100.peak_flops("bf16") == 312e12 and "fp8" not in a100.peak_flops_by_dtype
    assert ACCELERATORS["l40s"].peak_flops("fp8") == 733e12 and ACCELERATORS["l40s"].interconnect == 64e9
    assert ACCELERATORS["mi300x"].peak_flops("bf16") == 1307.4e12 and ACCELERATORS["mi300x"].memory_bytes == 192e9
    assert all("datasheet" in a.source.lower() or "data sheet" in a.source.lower() for a in ACCELERATORS.values())


def test_unknown_device_names_the_valid_ones() -> None:
    with pytest.raises(UnknownDeviceError, match=r"h100.*mi300x.*cpu") as info:
        accelerator("tpu-v5")
    assert isinstance(info.value, UserInputError)
    assert device_names() == ["a100", "h100", "h200", "h800", "l40s", "mi300x", "cpu"]


def test_fp8_on_an_a100_is_a_typed_error() -> None:
    with pytest.raises(DeviceDTypeError, match=r"a100.*no fp8.*fp32, bf16, fp16"):
        accelerator("a100").peak_flops("fp8")
    with pytest.raises(DeviceDTypeError):
        Roofline(model_arch("llama-3.1-8b"), accelerator("a100"), "fp8")


def test_measure_cpu_times_this_machine() -> None:
    cpu = measure_cpu(threads=1, matmul_n=64, copy_bytes=1 << 20, repeats=1)
    assert cpu.name == "cpu" and cpu.source.startswith("measured on this machine")
    assert cpu.peak_flops("fp32") > 0 and cpu.memory_bandwidth > 0 and cpu.memory_bytes > 2**26
    assert cpu.interconnect == cpu.memory_bandwidth
    with pytest.raises(DeviceDTypeError, match="has fp32"):
        cpu.peak_flops("bf16")


# ------------------------------------------------------------------ the roofline, by hand
def test_prefill_flops_of_1000_tokens(h100_8b: Roofline) -> None:
    # matmuls of 1000 tokens, logits of the last one, causal attention: token j attends to j + 1 keys
    expected = 2 * 6_979_588_096 * 1000 + 2 * 128256 * 4096 + 4 * 32 * 32 * 128 * 1000 * (0 + 1001 / 2)
    assert h100_8b.prefill_flops(0, 1000) == pytest.approx(expected, rel=1e-12)
    assert h100_8b.prefill_flops(0, 1000) == pytest.approx(
        sum(2 * LLAMA8_LINEAR + ATTN * (j + 1) for j in range(1000)) + 2 * 128256 * 4096, rel=1e-12)


def test_prefill_of_32768_with_30000_cached_is_compute_bound(h100_8b: Roofline) -> None:
    q = 32768 - 30000
    flops = 2 * LLAMA8_LINEAR * q + 2 * 128256 * 4096 + ATTN * q * (30000 + (q + 1) / 2)
    est = h100_8b.prefill(30000, 32768)
    assert est.flops == pytest.approx(flops, rel=1e-12)
    assert est.seconds == pytest.approx(flops / (989.4e12 * 0.5), rel=1e-12)  # about 0.170 s
    assert est.compute_bound and est.basis == "roofline (h100, efficiency 0.5)"
    assert est.bytes_per_device == LLAMA8_WEIGHTS + 32768 * KV_PER_TOKEN


def test_a_short_prefill_is_held_up_by_reading_the_weights(h100_8b: Roofline) -> None:
    est = h100_8b.prefill(100, 101)
    assert not est.compute_bound
    assert est.seconds == pytest.approx((LLAMA8_WEIGHTS + 101 * KV_PER_TOKEN) / (3.35e12 * 0.8), rel=1e-12)
    assert h100_8b.prefill_seconds(5, 5) == 0.0


def test_decode_step_of_one_sequence_at_4k(h100_8b: Roofline) -> None:
    est = h100_8b.decode_step(1, 4096)
    assert est.seconds == pytest.approx((16_060_522_496 + 4096 * 131072) / (3.35e12 * 0.8), rel=1e-12)  # 6.19 ms
    assert not est.compute_bound
    assert est.flops == 2 * 8_030_261_248 + ATTN * 4096


def test_tp_divides_compute_weights_and_kv_per_device() -> None:
    one = Roofline(model_arch("llama-3.1-70b"), accelerator("h100"), "bf16")
    four = replace(one, tp=4)
    assert four.weight_bytes_per_device == one.weight_bytes / 4
    assert four.kv_spec.bytes_per_token == one.kv_spec.bytes_per_token // 4
    # compute / 4, plus the all-reduces: 2 per layer of 32768 x 8192 bf16 activations, ring over 4
    # devices (2 * 3/4 of the bytes each way at 900/2 GB/s)
    comm = 2 * 80 * (2 * 3 / 4) * (32768 * 8192 * 2) / 450e9
    assert four.allreduce_seconds(32768) == pytest.approx(comm, rel=1e-12)
    assert four.prefill_seconds(0, 32768) == pytest.approx(one.prefill_seconds(0, 32768) / 4 + comm, rel=1e-12)
    assert one.allreduce_seconds(32768) == 0.0


def test_moe_decode_reads_the_experts_a_batch_touches() -> None:
    ds = Roofline(model_arch("deepseek-v3"), accelerator("h200"), "fp8", tp=8)
    routed = 58 * 256 * 3 * 7168 * 2048  # 58 MoE layers of 256 experts
    one = ds.decode_weight_bytes_per_device(1)
    assert one == pytest.approx((671e9 - routed * (1 - 8 / 256)) / 8, rel=1e-12)
    assert one < ds.decode_weight_bytes_per_device(64) < ds.weight_bytes_per_device


def test_kv_capacity_next_to_the_weights(h100_8b: Roofline) -> None:
    assert h100_8b.kv_capacity_tokens() == (72e9 - 16_060_522_496) // 131072  # 426,784 tokens
    assert h100_8b.kv_capacity_tokens(0.5) == (40e9 - 16_060_522_496) // 131072


def test_a_model_too_large_names_model_device_and_both_sizes() -> None:
    roof = Roofline(model_arch("llama-3.1-70b"), accelerator("l40s"), "bf16")
    with pytest.raises(ModelTooLargeError, match=r"Llama-3\.1-70B.*l40s: 131\.42 GiB of weights.*40\.23 GiB usable"):
        roof.kv_capacity_tokens()
    fit = fit_on_device(model_arch("llama-3.1-70b"), accelerator("l40s"), "bf16",
                        from_preset("llama-3.1-70b", tp_size=4))
    assert fit.tokens > 0 and fit.weight_bytes_per_device == 2 * model_arch("llama-3.1-70b").total_params / 4


@pytest.mark.parametrize("kw", [{"prefill_efficiency": 0.0}, {"prefill_efficiency": 1.5},
                                {"prefill_efficiency": float("nan")}, {"decode_bandwidth_efficiency": -0.1},
                                {"tp": 0}, {"tp": -2}])
def test_bad_settings_name_the_field(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        Roofline(model_arch("llama-3.1-8b"), accelerator("h100"), "bf16", **kw)  # type: ignore[arg-type]


def test_bad_ranges_are_plan_input_errors(h100_8b: Roofline) -> None:
    with pytest.raises(PlanInputError, match="cached"):
        h100_8b.prefill_flops(10, 5)
    with pytest.raises(PlanInputError, match="batch"):
        h100_8b.decode_step(0, 10)


def test_the_prefill_model_is_the_roofline_for_the_cost_model(h100_8b: Roofline) -> None:
    pm = h100_8b.prefill_model(now=1.0)
    assert isinstance(pm, PrefillModel) and pm.model_id == "meta-llama/Llama-3.1-8B" and pm.measured_at == 1.0
    assert pm.seconds(30000, 32768) == h100_8b.prefill_seconds(30000, 32768)
    assert pm.seconds(100, 101) == h100_8b.prefill_seconds(100, 101)  # the memory floor too
    # a, b, c, d: the compute-bound part as the profile's polynomial
    assert pm.a + pm.b * 2768 + pm.c * 2768**2 + pm.d * 2768 * 30000 == pytest.approx(
        h100_8b.prefill_flops(30000, 32768) / (989.4e12 * 0.5), rel=1e-9)
    assert replace(pm, scale=2.0).seconds(0, 32768) == 2 * pm.seconds(0, 32768)


# ------------------------------------------------------------------ kvport plan / size --device
PLAN = ["plan", "--model", "llama-3.1-8b", "--tokens", "32768", "--cached", "30000"]


def test_plan_on_an_h100_over_its_nvlink_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--device", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["basis"]["basis"] == "roofline (h100, efficiency 0.5)" and out["basis"]["calibrated"] is False
    assert out["basis"]["device"]["source"] == ACCELERATORS["h100"].source
    assert out["basis"]["link"] == {"name": "peer", "bandwidth_bytes_per_second": 900e9, "latency": 0.0,
                                    "source": "h100 interconnect"}
    assert out["status"] == "ok" and out["choice"] == "load:peer"
    seconds = {o["label"]: o["seconds"] for o in out["options"]}
    assert seconds["recompute"] == pytest.approx(Roofline(model_arch("llama-3.1-8b"), accelerator("h100"),
                                                          "bf16").prefill_seconds(0, 32768))
    assert all(s is not None for s in seconds.values())


def test_plan_on_an_h100_over_25gbps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--bandwidth", "25Gbps", "--device", "h100", "--efficiency", "0.4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["basis"]["basis"] == "roofline (h100, efficiency 0.4)" and out["basis"]["link"]["source"] == "what-if"
    seconds = {o["label"]: o["seconds"] for o in out["options"]}
    assert seconds["load:peer"] < seconds["recompute"]  # 3.9 GB at 3.1 GB/s beats 1.9 s of prefill
    assert out["action"] in ("load", "split") and out["crossover"]["recompute_wins_at_shortest"] is not None


def test_plan_text_prints_the_basis(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--device", "mi300x", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "basis     roofline (mi300x, efficiency 0.5)" in out and "tp 2" in out and "unknown" not in out


def test_plan_on_cpu_uses_a_calibration_of_the_same_model(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    pf = PrefillModel(model_id=MODEL_ID, threads=1, a=0.02, b=2e-3, c=1e-7, d=2e-7, measured_at=now)
    Profile(machine=machine_id(), created=now, prefill=pf).save(tmp_path / "p.json")
    fake = Accelerator("cpu", "test cpu", {"fp32": 1e11}, 1e10, 16e9, 1e10, source="measured on this machine")
    monkeypatch.setattr("kvport.cli.plan_cmd.measure_cpu", lambda: fake)
    args = ["plan", "--model", "smollm2-135m", "--tokens", "2048", "--cached", "1984", "--device", "cpu", "--json"]
    assert main([*args, "--profile", str(tmp_path / "p.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["basis"]["calibrated"] is True and out["basis"]["basis"] == f"calibrated ({tmp_path / 'p.json'})"
    assert out["options"][0]["seconds"] == pytest.approx(pf.seconds(0, 2048))
    # another model's calibration: this CPU's roofline (fp32: the only rate measured)
    assert main(["plan", "--model", "llama-3.2-1b", "--tokens", "2048", "--cached", "1984", "--device", "cpu",
                 "--weights-dtype", "fp32", "--profile", str(tmp_path / "p.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["basis"]["basis"] == "roofline (cpu, efficiency 0.5)" and out["basis"]["calibrated"] is False
    assert "measured for" in out["basis"]["why_not_calibrated"]


@pytest.mark.parametrize(("args", "flag"), [
    (["--device", "tpu"], "--device"),
    (["--device", "h100", "--efficiency", "0"], "--efficiency"),
    (["--device", "h100", "--efficiency", "1.5"], "--efficiency"),
    (["--device", "h100", "--efficiency", "nan"], "--efficiency"),
    (["--device", "h100", "--tp", "0"], "--tp"),
    (["--device", "h100", "--tp", "-1"], "--tp"),
    (["--device", "a100", "--weights-dtype", "fp8"], "--weights-dtype"),
    (["--device", "h100", "--weights-dtype", "int3"], "--weights-dtype"),
    (["--efficiency", "0.5"], "--efficiency"),
    (["--tp", "2"], "--tp"),
])
def test_plan_bad_device_inputs_exit_2_naming_the_flag(args: list[str], flag: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "\n" not in err


def test_plan_of_a_model_too_large_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-70b", "--tokens", "100", "--cached", "50", "--device", "l40s"]) == 2
    assert "does not fit on l40s" in capsys.readouterr().err


def test_size_on_an_h100(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "--model", "llama-3.1-8b", "--tokens", "32768", "--device", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_bytes_per_device"] == 16_060_522_496 and out["device"]["memory_bytes"] == 80e9
    assert out["tokens_fitting"] == (72e9 - 16_060_522_496) // 131072
    assert out["memory_bytes"] == int(72e9 - 16_060_522_496)
    assert main(["size", "--model", "llama-3.1-70b", "--tokens", "10", "--device", "h100", "--tp", "4"]) == 0
    assert "weights          32.85 GiB per device (bf16, tp=4)" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "flag"), [
    (["--device", "h100", "--memory", "10GiB"], "--memory"),
    (["--device", "h100", "--memory-fraction", "0"], "--memory-fraction"),
    (["--weights-dtype", "fp8"], "--weights-dtype"),
    (["--device", "nope"], "--device"),
    (["--model", "llama-3.1-70b", "--device", "l40s"], "l40s"),
])
def test_size_bad_device_inputs_exit_2(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "--model", "llama-3.1-8b", "--tokens", "10", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "\n" not in err

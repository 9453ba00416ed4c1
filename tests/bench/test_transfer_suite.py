import json

import numpy as np
import pytest

from kvport.bench.harness import SuiteOptions
from kvport.bench.transfer import ModelLayerCompute, _layerwise
from kvport.bench.transfer_load import SleepCompute, layerwise_overlap, pipeline_bound
from kvport.cli.main import main
from kvport.errors import UserInputError
from kvport.spec import DType, from_hf_config


@pytest.mark.slow
def test_transfer_suite_report_shape(capsys, tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--quick", "--json", str(path), "--set", "mib=8", "--set", "trials=1",
            "--set", "overload_s=0.5", "--set", "layerwise_tokens=64"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(path.read_text())
    assert printed == saved
    assert set(saved) == {"format", "suite", "conditions", "limits", "results"} and saved["suite"] == "transfer"
    for k in ("cpu_count", "loadavg_start", "loadavg_end", "versions", "process_layout"):
        assert k in saved["conditions"]
    for k in ("memcpy_gbps", "raw_socket_gbps", "raw_socket_same_layout_gbps"):
        assert saved["limits"][k] is None or saved["limits"][k] > 0
    r = saved["results"]
    for k in ("tcp_vs_raw_socket", "shm_vs_memcpy", "tcp_gbps", "shm_gbps", "tcp_producer_digests_vs_raw_socket"):
        assert r[k] > 0
    cc = saved["conditions"]["tcp_congestion"]  # one tuning for kvport's link and the raw baseline
    assert cc["kvport"] == cc["raw_same_layout"]
    assert r["tcp_time"]["ideal_s"] > 0 and r["tcp_time"]["measured_s"] > 0
    for key in ("overload", "overload_no_backpressure"):
        for f in ("peak_memory_vs_budget", "lost_blocks", "goodput_vs_capacity"):
            assert f in r[key]
    assert r["overload"]["backpressure"] is True and r["overload_no_backpressure"]["backpressure"] is False
    assert r["overload"]["lost_blocks"] == 0 and r["overload"]["peak_memory_vs_budget"] <= 1.0
    line = r["overload"]["timeline"]  # over time, as the report draws it: never above the budget, nothing lost
    assert len(line["t_s"]) == len(line["memory_bytes"]) == len(line["goodput_mbps"]) >= 2
    assert max(line["memory_bytes"]) <= r["overload"]["budget_bytes"] and line["lost_blocks"][-1] == 0
    assert line["t_s"] == sorted(line["t_s"])
    lw = r["layerwise"]
    assert lw["streamed_s"] > 0 and lw["sequential_s"] > 0
    # the real model's layers by default, and the report says so
    spec = from_hf_config(model_dir, dtype=DType.FP32)
    assert lw["compute"].startswith("smollm2-135m layer forward, 64 tokens")
    assert saved["conditions"]["layerwise_compute"] == lw["compute"]
    assert lw["layers"] == spec.num_layers and lw["layer_bytes"] == 64 * spec.bytes_per_token // spec.num_layers
    assert lw["link"].startswith("balanced") and 0 < lw["bound_s"] <= lw["sum_s"]


def test_sleep_compute_is_labelled_a_stand_in() -> None:
    lw = _layerwise(SuiteOptions(quick=True, extra={"compute": "sleep"}))
    assert "stand-in" in lw["compute"] and "sleep 25 ms" in lw["compute"]
    assert lw["layers"] == 8 and lw["link"] == "fixed" and lw["transfer_per_layer_s"] == 0.025
    with pytest.raises(UserInputError, match="compute=gpu"):
        _layerwise(SuiteOptions(quick=True, extra={"compute": "gpu"}))


def test_every_layer_arrives_once_in_order_with_its_bytes() -> None:
    sleep = SleepCompute(layers=3, compute_s=0.001, n_blocks=2)
    seen: list[tuple[int, int]] = []
    times = sleep.run(lambda i, blocks: seen.append((i, sum(b.nbytes for b in blocks))))
    assert seen == [(i, 2 * sleep.spec.bytes_per_layer_block) for i in range(3)] and len(times) == 3
    out = layerwise_overlap(sleep, layer_transfer_s=0.001)
    assert out["layers"] == 3 and set(out["compute_total_s"]) == {"sequential", "streamed"}


def test_pipeline_bound_is_the_two_stage_flow_shop() -> None:
    assert pipeline_bound([2.0] * 4, 1.0) == 4 * 2.0 + 1.0  # compute-bound: all compute, then one send
    assert pipeline_bound([1.0] * 4, 2.0) == 1.0 + 4 * 2.0  # link-bound: one layer, then all sends
    assert pipeline_bound([1.0, 5.0, 1.0], 2.0) == 1.0 + 5.0 + 2 * 2.0  # the slow layer splits it
    assert pipeline_bound([], 1.0) == 0.0


@pytest.mark.slow
def test_model_compute_streams_each_layers_real_kv(model_dir) -> None:  # type: ignore[no-untyped-def]
    import torch

    from kvport.planner import hfkv
    from kvport.planner.calibrate import reference_ids
    from kvport.refmodel import MODEL_ID, load

    model, tok = load(model_dir)
    spec = from_hf_config(model_dir, dtype=DType.FP32, model_id=MODEL_ID)
    ids = reference_ids(tok, 32)
    compute = ModelLayerCompute(model, spec, ids, "smollm2-135m")
    got = np.zeros(compute.n_blocks * spec.bytes_per_block, dtype=np.uint8)
    rows = got.reshape(compute.n_blocks, spec.bytes_per_block)
    lb = spec.bytes_per_layer_block
    order: list[int] = []

    def keep(i: int, blocks) -> None:  # type: ignore[no-untyped-def]
        order.append(i)
        for j, b in enumerate(blocks):
            rows[j, i * lb : (i + 1) * lb] = np.frombuffer(b, dtype=np.uint8)

    times = compute.run(keep)
    assert order == list(range(spec.num_layers)) and len(times) == spec.num_layers
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    want = np.zeros_like(got)
    hfkv.cache_to_blocks(out.past_key_values, spec, 0, 32, want)
    np.testing.assert_allclose(got.view(np.float32), want.view(np.float32), rtol=0, atol=1e-5)
    with pytest.raises(UserInputError, match="whole blocks"):
        ModelLayerCompute(model, spec, reference_ids(tok, 20), "smollm2-135m")

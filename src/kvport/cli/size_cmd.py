"""``kvport size``: the KV size calculator and ideal transfer lower bound.

``--device`` sizes the KV budget from an accelerator (:mod:`kvport.planner.devices`): weights per
device (``--tp``, ``--weights-dtype``), and the tokens of KV that fit next to them in
``--memory-fraction`` of the device's memory. ``--memory`` (a KV budget given outright) and
``--device`` (a budget derived from the device) answer the same question two ways: together they
are refused, not ranked.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import click

from kvport.cli._params import as_bandwidth, as_device, as_dtype, as_fraction, as_size
from kvport.errors import UserInputError
from kvport.planner import accelerator, model_arch
from kvport.planner.roofline import DEFAULT_MEMORY_FRACTION, DeviceFit, fit_on_device
from kvport.spec import KVSpec, preset_names, resolve
from kvport.units import format_bytes, format_seconds


@dataclass(frozen=True, slots=True)
class SizeReport:
    model: str
    dtype: str
    tokens: int
    tp_size: int
    latent: bool
    kv_bytes: int
    bytes_per_token: int
    bytes_per_token_layer: int
    bytes_per_layer: int
    bytes_per_block: int
    block_size: int
    bandwidth_bytes_per_second: float | None
    ideal_transfer_seconds: float | None
    memory_bytes: int | None  # the KV budget: --memory, or with --device what the weights leave
    tokens_fitting: int | None
    device: dict[str, object] | None = None  # the accelerator preset (or measured cpu), with --device
    weights_dtype: str | None = None
    weight_bytes_per_device: float | None = None
    memory_fraction: float | None = None
    note: str = ("ideal_transfer_seconds = kv_bytes / bandwidth is a lower bound: real transfers add "
                 "serialization and synchronization (see `kvport bench transfer`)")


def compute(spec: KVSpec, tokens: int, bandwidth: float | None, memory: int | None,
            fit: DeviceFit | None = None) -> SizeReport:
    """Sizes of ``tokens`` tokens; with ``fit`` the KV budget is the device memory its weights leave."""
    if tokens <= 0:
        raise UserInputError(f"--tokens must be positive, got {tokens}")
    if memory is not None and memory < spec.bytes_per_token:
        # a budget that holds no token is a mistyped budget (a unit left out: "80" is 80 bytes), not a plan
        raise UserInputError(f"--memory {format_bytes(memory)} holds no token of {spec.model_id}: one token's KV "
                             f"is {format_bytes(spec.bytes_per_token)} (a unit missing? e.g. 80GiB)")
    kv = spec.request_bytes(tokens)
    fitting = None if memory is None else memory // spec.bytes_per_token
    if fit is not None:
        fitting, memory = fit.tokens, int(fit.kv_budget_bytes)
    return SizeReport(
        model=spec.model_id, dtype=spec.dtype.value, tokens=tokens, tp_size=spec.tp_size,
        latent=spec.latent, kv_bytes=kv, bytes_per_token=spec.bytes_per_token,
        bytes_per_token_layer=spec.bytes_per_token_layer, bytes_per_layer=spec.layer_bytes(tokens),
        bytes_per_block=spec.bytes_per_block, block_size=spec.block_size,
        bandwidth_bytes_per_second=bandwidth,
        ideal_transfer_seconds=None if bandwidth is None else kv / bandwidth,
        memory_bytes=memory, tokens_fitting=fitting,
        device=None if fit is None else fit.device.as_dict(),
        weights_dtype=None if fit is None else fit.weights_dtype,
        weight_bytes_per_device=None if fit is None else fit.weight_bytes_per_device,
        memory_fraction=None if fit is None else fit.memory_fraction,
    )


@click.command()
@click.option("--model", required=True, help=f"preset ({', '.join(preset_names())}) or a config.json path")
@click.option("--tokens", required=True, type=click.IntRange(min=1), help="tokens of KV (prompt + generated)")
@click.option("--dtype", default=None, help="KV element type: fp32, fp16, bf16, fp8 (default: the model's)")
@click.option("--bandwidth", default=None, callback=as_bandwidth, metavar="BANDWIDTH",
              help="effective link bandwidth, e.g. 20GiB/s, 100Gbps")
@click.option("--memory", default=None, callback=as_size, metavar="SIZE", help="memory budget for KV, e.g. 80GiB")
@click.option("--block-size", default=16, type=click.IntRange(min=1), show_default=True, help="tokens per block")
@click.option("--tp", "tp_size", default=1, type=click.IntRange(min=1), show_default=True,
              help="tensor-parallel size (per-rank sizes)")
@click.option("--device", default=None, callback=as_device, metavar="NAME",
              help="KV budget from an accelerator: its memory less the weights (h100, h200, h800, a100, l40s, "
              "mi300x, cpu); not with --memory")
@click.option("--weights-dtype", default=None, help="with --device: dtype of the weights (default: the model's)")
@click.option("--memory-fraction", default=None, type=float, callback=as_fraction,
              help=f"with --device: share of device memory for weights + KV (default {DEFAULT_MEMORY_FRACTION})")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def size(model: str, tokens: int, dtype: str | None, bandwidth: float | None, memory: int | None,
         block_size: int, tp_size: int, device: str | None, weights_dtype: str | None, memory_fraction: float | None,
         as_json: bool) -> None:
    """KV bytes for a model and prompt length; ideal transfer time; tokens that fit in memory."""
    if device is not None and memory is not None:
        raise click.BadParameter("is a KV budget and --device derives one from the device's memory and the "
                                 "model's weights: give one of them", param_hint="'--memory'")
    for flag, value in (("--weights-dtype", weights_dtype), ("--memory-fraction", memory_fraction)):
        if value is not None and device is None:
            raise click.BadParameter("sizes the weights on a device: give --device too", param_hint=f"'{flag}'")
    spec = resolve(model, dtype=dtype, block_size=block_size, tp_size=tp_size)
    fit = None
    if device is not None:
        wdt = None if weights_dtype is None else as_dtype(weights_dtype, "--weights-dtype")
        arch = model_arch(model)
        fit = fit_on_device(arch, accelerator(device), wdt or arch.dtype.value, spec,
                            memory_fraction or DEFAULT_MEMORY_FRACTION)  # ModelTooLargeError: exit 2
    rep = compute(spec, tokens, bandwidth, memory, fit)
    if as_json:
        click.echo(json.dumps(asdict(rep), indent=2))
        return
    lines = [
        f"model            {rep.model} ({rep.dtype}{', MLA latent' if rep.latent else ''}, tp={rep.tp_size})",
        f"tokens           {rep.tokens:,}",
        f"KV total         {format_bytes(rep.kv_bytes)} ({rep.kv_bytes:,} bytes)",
        f"per token        {format_bytes(rep.bytes_per_token)} ({rep.bytes_per_token_layer:,} bytes per layer)",
        f"per layer        {format_bytes(rep.bytes_per_layer)}",
        f"per block        {format_bytes(rep.bytes_per_block)} ({rep.block_size} tokens)",
    ]
    if rep.ideal_transfer_seconds is not None and rep.bandwidth_bytes_per_second is not None:
        lines.append(f"ideal transfer   {format_seconds(rep.ideal_transfer_seconds)} at "
                     f"{format_bytes(rep.bandwidth_bytes_per_second)}/s (lower bound; real transfers add "
                     "serialization + sync)")
    if fit is not None:
        acc = fit.device
        lines += [f"device           {acc.name} ({acc.product}): {format_bytes(acc.memory_bytes)} "
                  f"({acc.memory_bytes / 1e9:g} GB), {fit.memory_fraction:g} of it for weights + KV",
                  f"weights          {format_bytes(fit.weight_bytes_per_device)} per device ({fit.weights_dtype}, "
                  f"tp={fit.tp})"]
    if rep.tokens_fitting is not None and rep.memory_bytes is not None:
        lines.append(f"fits in memory   {rep.tokens_fitting:,} tokens in {format_bytes(rep.memory_bytes)}"
                     + (" of KV per device" if fit is not None else ""))
    click.echo("\n".join(lines))

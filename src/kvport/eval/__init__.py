"""Quality harness: KV codecs judged on the reference model (perplexity, top-1 agreement, KL).

``evaluate(model, tokenizer, codecs, QualityOptions(tokens, windows, sets))`` -> :class:`QualityReport`;
``kvport eval quality --codec NAME`` is the command-line form; :func:`provenance` is the block it
writes beside the report (date, command, commit). Needs the ``eval`` extra (torch, transformers, numba).

::

    quality     evaluate(): perplexity vs the unquantized baseline, top-1 agreement and KL, beside the size ratio
    attention   the attention function that runs a codec on K and V exactly where attention reads them
    texts       deterministic held-out text sets (``code``, ``prose``) that every Python install carries
    provenance  where a result came from: date, command, kvport's version and source commit
    kcalib      ``mixed``'s key-channel calibration on the reference model (``python -m kvport.eval.kcalib``)
"""

from kvport.extras import require

try:
    from kvport.eval.provenance import provenance
    from kvport.eval.quality import CodecQuality, QualityOptions, QualityReport, evaluate
    from kvport.eval.texts import TEXT_SETS, windows
except ImportError:
    require("eval", __name__)  # torch, transformers or numba not installed: one line naming the extra
    raise  # installed but broken: the original error

__all__ = ["TEXT_SETS", "CodecQuality", "QualityOptions", "QualityReport", "evaluate", "provenance", "windows"]

"""Deterministic held-out text that every Python install carries.

* ``code``:  the source of a fixed list of standard-library modules, concatenated in that order;
* ``prose``: the pydoc topics (``pydoc_data.topics.topics``), values in sorted key order.

The text depends only on the Python version (recorded in the conditions). Windows are consecutive,
non-overlapping ``tokens``-long slices of the tokenized text, from its start.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch

from kvport.errors import ConfigError

CODE_MODULES = ("textwrap.py", "argparse.py", "difflib.py", "inspect.py", "tarfile.py", "typing.py")
TEXT_SETS = ("code", "prose")


def code_text() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    try:
        return "".join((lib / name).read_text(encoding="utf-8") for name in CODE_MODULES)
    except OSError as exc:
        raise ConfigError(f"standard-library source not readable under {lib}: {exc}") from exc


def prose_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(str(topics[key]) for key in sorted(topics))


def text(name: str) -> str:
    if name == "code":
        return code_text()
    if name == "prose":
        return prose_text()
    raise ConfigError(f"unknown text set {name!r}: expected one of {', '.join(TEXT_SETS)}")


def windows(tokenizer: Any, name: str, tokens: int, count: int) -> list[torch.Tensor]:
    """``count`` consecutive windows of ``tokens`` token ids (int64, 1-D) of text set ``name``."""
    if tokens < 2 or count < 1:
        raise ConfigError(f"need tokens >= 2 and windows >= 1, got {tokens} and {count}")
    body = text(name)
    need_chars = tokens * count * 8  # about 3-4 chars per token here: tokenize only what is needed
    ids = tokenizer(body[:need_chars], return_tensors="pt").input_ids[0]
    if ids.numel() < tokens * count:
        ids = tokenizer(body, return_tensors="pt").input_ids[0]
    if ids.numel() < tokens * count:
        raise ConfigError(f"text set {name!r} has {ids.numel()} tokens, fewer than {tokens} x {count}")
    return [ids[i * tokens:(i + 1) * tokens].clone() for i in range(count)]

"""A test-only stand-in for `sgl_kernel` so that SGLang's CPU engine runs on a machine without its
CPU kernels (PyPI has no CPU build of sgl-kernel).

Only what SGLang's CPU path calls on the reference model is written out, in plain torch; any other
name imports (SGLang imports many names at module level) but raises when called, so a path that
needs a real kernel fails loudly instead of computing something else.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    raise NotImplementedError("sgl_kernel stand-in: copy_all_layer_kv_cache_cpu")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel stand-in has no {name}: this path needs the real kernels")

    missing.__name__ = name
    return missing

"""Under ``make wheelcheck``: these tests run against the installed wheel, core only.

``KVPORT_WHEELCHECK_SITE`` (set by tests/packaging/wheelcheck.py) is the venv's site-packages; run
elsewhere, these are skipped.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest

import kvport

SITE = os.environ.get("KVPORT_WHEELCHECK_SITE")
pytestmark = pytest.mark.skipif(not SITE, reason="only under make wheelcheck (the installed wheel)")


def test_kvport_is_the_installed_wheel_not_the_source_tree() -> None:
    assert SITE is not None
    assert Path(kvport.__file__).resolve().is_relative_to(Path(SITE).resolve())


@pytest.mark.parametrize("module", ["torch", "numba", "llvmlite", "transformers", "vllm"])
def test_the_core_install_brought_no_framework(module: str) -> None:
    assert importlib.util.find_spec(module) is None

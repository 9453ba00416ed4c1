"""Run Python code as if kvport's optional packages were not installed (torch, numba, ...).

A meta path finder answers "No module named ..." for them, as a core-only environment does; the
code runs in a child process so that this one keeps its imports.
"""

from __future__ import annotations

import subprocess
import sys

OPTIONAL = ("torch", "numba", "llvmlite", "transformers", "vllm", "gguf", "accelerate", "safetensors", "hiredis",
            "sglang", "nixl")

BLOCKER = f"""
import sys

class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""


def run_blocked(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter where the optional packages cannot be imported."""
    return subprocess.run([sys.executable, "-c", BLOCKER + code, *args], capture_output=True, text=True,
                          timeout=timeout)


def run_cli_blocked(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvport ARGS`` without the optional packages."""
    return run_blocked("from kvport.cli.main import main\nraise SystemExit(main(sys.argv[1:]))", *args)

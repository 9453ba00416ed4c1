"""The server, transfer, store and tier layers start without torch or numba: the server's host pool is
its capacity minus its measured resident memory, so every heavy import there shrinks the pool."""

from __future__ import annotations

import subprocess
import sys


def test_server_transfer_store_tiers_import_without_torch_or_numba() -> None:
    code = ("import sys, kvport.server.app, kvport.transfer, kvport.store, kvport.tiers, kvport.cli.serve_cmd; "
            "heavy = sorted(m for m in ('torch', 'numba', 'transformers') if m in sys.modules); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == ""

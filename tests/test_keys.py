import subprocess
import sys

import numpy as np
import pytest

from kvport.errors import KeyingError
from kvport.keys import KEY_BYTES, HashAlgo, KeyContext, chain_keys, key_from_hex
from kvport.spec import from_preset

CTX = KeyContext(block_size=16, spec_fingerprint=from_preset("smollm2-135m").fingerprint)


def test_keys_are_fixed_size_and_chained() -> None:
    toks = np.arange(100)
    keys = chain_keys(toks, CTX)
    assert len(keys) == 6  # partial last block not keyed by default
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 6
    assert len(chain_keys(toks, CTX, include_partial=True)) == 7
    # continuing a chain from a parent equals keying the whole prefix
    assert chain_keys(toks[16:], CTX, parent=keys[0]) == keys[1:]


def test_prefix_property_and_divergence() -> None:
    a = np.arange(64)
    b = a.copy()
    b[40] = 999  # differs in block 2
    ka, kb = chain_keys(a, CTX), chain_keys(b, CTX)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]
    # the same block content under a different parent gets a different key
    c = np.concatenate([np.full(16, 7), a[16:32]])
    assert chain_keys(c, CTX)[1] != ka[1]


def test_input_types_agree() -> None:
    toks = np.random.default_rng(1).integers(0, 50000, 300)
    ref = chain_keys(toks.astype(np.int32), CTX)
    assert chain_keys(toks.astype(np.int64), CTX) == ref
    assert chain_keys(toks.tolist(), CTX) == ref
    assert chain_keys(toks.astype(np.int64)[::-1][::-1], CTX) == ref
    big = np.random.default_rng(2).integers(0, 50000, 200_000)  # crosses the conversion chunk size
    assert chain_keys(big, CTX) == chain_keys(big.astype("<i4"), CTX)


@pytest.mark.parametrize("field", ["spec_fingerprint", "tenant_salt", "codec_id", "algo", "block_size"])
def test_every_extra_key_changes_every_key(field: str) -> None:
    toks = np.arange(64)
    changes = {"spec_fingerprint": b"x" * 16, "tenant_salt": b"tenant-b", "codec_id": "int8",
               "algo": HashAlgo.SHA256, "block_size": 32}
    kw = dict(block_size=16, spec_fingerprint=CTX.spec_fingerprint)
    other = KeyContext(**{**kw, field: changes[field]})  # type: ignore[arg-type]
    a, b = chain_keys(toks, KeyContext(**kw)), chain_keys(toks, other)  # type: ignore[arg-type]
    assert not set(a) & set(b)


def test_hex_round_trip() -> None:
    k = chain_keys(np.arange(16), CTX)[0]
    assert key_from_hex(k.hex()) == k
    with pytest.raises(KeyingError):
        key_from_hex("zz")
    with pytest.raises(KeyingError):
        key_from_hex("ab")


@pytest.mark.parametrize("bad", [np.zeros((2, 16), dtype=np.int32), np.zeros(16, dtype=np.float32),
                                 np.array([2**40] * 16), np.array(["a"] * 16)])
def test_bad_tokens_are_typed_errors(bad: np.ndarray) -> None:
    with pytest.raises(KeyingError):
        chain_keys(bad, CTX)


def test_bad_context_and_parent() -> None:
    with pytest.raises(KeyingError):
        KeyContext(block_size=0)
    with pytest.raises(KeyingError):
        chain_keys(np.arange(16), CTX, parent=b"short")


_CHILD = """
import sys, numpy as np
from kvport.keys import KeyContext, HashAlgo, chain_keys
from kvport.spec import from_preset
ctx = KeyContext(block_size=16, spec_fingerprint=from_preset("llama-3.1-8b").fingerprint, tenant_salt=b"t1",
                 algo=HashAlgo(sys.argv[1]))
print(",".join(k.hex() for k in chain_keys(np.arange(1000) * 7 % 50000, ctx)))
"""


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_stable_across_processes_and_hash_seeds(algo: str) -> None:
    outs = []
    for seed in ("1", "12345"):
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        out = subprocess.run([sys.executable, "-c", _CHILD, algo], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
        outs.append(out)
    assert outs[0] == outs[1]
    ctx = KeyContext(block_size=16, spec_fingerprint=from_preset("llama-3.1-8b").fingerprint, tenant_salt=b"t1",
                     algo=HashAlgo(algo))
    assert outs[0] == ",".join(k.hex() for k in chain_keys(np.arange(1000) * 7 % 50000, ctx))

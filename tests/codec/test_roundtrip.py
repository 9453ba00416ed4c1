"""Round trips: exact for raw and lossless, bounded error for the lossy codecs."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from kvport.codec import KVShape, codec_from_dict, codec_ids, codec_key, codec_to_dict, get_codec
from kvport.keys import KeyContext, chain_keys
from kvport.spec import DType
from tests.codec.conftest import kv


def _roundtrip(codec_id: str, k: torch.Tensor, v: torch.Tensor, **params: object) -> tuple[torch.Tensor, ...]:
    c = get_codec(codec_id, **params)
    enc = c.encode(k, v)
    ko, vo = torch.empty_like(k), torch.empty_like(v)
    c.decode(enc, ko, vo)
    return ko, vo, enc  # type: ignore[return-value]


def test_registry_lists_all_codecs() -> None:
    assert codec_ids() == ["int8", "kivi4", "lossless", "mixed", "raw"]


@pytest.mark.parametrize("codec_id", ["raw", "lossless"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lossless_codecs_are_exact(codec_id: str, dtype: torch.dtype) -> None:
    k, v = kv(tokens=21, dtype=dtype)
    ko, vo, _ = _roundtrip(codec_id, k, v)
    assert torch.equal(ko.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(vo.view(torch.uint8), v.view(torch.uint8))


def test_lossless_compresses_bf16_exponents() -> None:
    k, v = kv(tokens=256)
    _, _, enc = _roundtrip("lossless", k, v)
    assert 1.1 < enc.ratio < 2.0  # the exponent plane compresses, the mantissa plane barely


def _row_range(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.amax(dim=dims, keepdim=True) - x.amin(dim=dims, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_error_is_within_one_step_per_row(dtype: torch.dtype) -> None:
    k, v = kv(dtype=dtype)
    ko, vo, enc = _roundtrip("int8", k, v)
    for x, y in ((k, ko), (v, vo)):
        xf, yf = x.float(), y.float()
        lo = xf.amin(-1, keepdim=True).clamp(max=0)
        hi = xf.amax(-1, keepdim=True).clamp(min=0)
        step = (hi - lo) / 255
        # half a step of rounding plus up to half a step of integer zero-point shift
        assert ((yf - xf).abs() <= step * 1.01 + xf.abs() * 2**-8 + 1e-6).all()
    assert abs(enc.ratio - 128 / 67) < 0.01  # a row: D codes + fp16 scale + u8 zero point, vs 2D bytes


def test_int8_bf16_output_is_the_fp32_output_rounded() -> None:
    k, v = kv(dtype=torch.bfloat16)
    c = get_codec("int8")
    enc = c.encode(k, v)
    kb, vb = torch.empty_like(k), torch.empty_like(v)
    c.decode(enc, kb, vb)
    # the int8 payload does not depend on the KV dtype: decode the same bytes as fp32
    k32, v32 = torch.empty_like(k, dtype=torch.float32), torch.empty_like(v, dtype=torch.float32)
    c.decode(enc.payload, k32, v32, shape=dataclasses.replace(enc.shape, dtype=DType.FP32))
    assert torch.equal(kb, k32.bfloat16()) and torch.equal(vb, v32.bfloat16())


def test_kivi4_errors_per_channel_group_and_per_row() -> None:
    k, v = kv(tokens=70, dtype=torch.float32)
    ko, vo, _ = _roundtrip("kivi4", k, v, group=32)
    for g0 in range(0, 70, 32):
        sl = slice(g0, min(70, g0 + 32))
        step = _row_range(k[:, :, sl], (2,)) / 15
        assert ((ko[:, :, sl] - k[:, :, sl]).abs() <= step * 0.5 * 1.01 + k[:, :, sl].abs() * 1e-3 + 1e-5).all()
    step = _row_range(v, (3,)) / 15
    assert ((vo - v).abs() <= step * 0.5 * 1.01 + v.abs() * 1e-3 + 1e-5).all()
    long = get_codec("kivi4").encoded_size(KVShape(30, 3, 1024, 64, DType.BF16))
    assert 30 * 3 * 1024 * 64 * 4 / long > 3.55  # group 64 (the default)


def test_mixed_keeps_sinks_and_recent_at_8_bits_and_middle_bounded() -> None:
    k, v = kv(tokens=300, dtype=torch.float32)
    unrotated = {"k_rope_theta": None, "v_rotate": False}  # errors bounded in the stored domain
    ko, vo, enc = _roundtrip("mixed", k, v, sinks=4, recent=16, group=32, k_bits=4, target_ratio=None,
                            calib=None, **unrotated)
    for x, y in ((k, ko), (v, vo)):
        for sl in (slice(0, 4), slice(284, 300)):
            lo = x[:, :, sl].amin(-1, keepdim=True).clamp(max=0)
            hi = x[:, :, sl].amax(-1, keepdim=True).clamp(min=0)
            # int8 rows: the integer zero point shifts the grid by up to half a step
            assert ((y[:, :, sl] - x[:, :, sl]).abs() <= (hi - lo) / 255 * 1.01 + 1e-4).all()
    mid = slice(4, 284)
    codec = get_codec("mixed", sinks=4, recent=16, group=32, k_bits=4, target_ratio=None, calib=None, **unrotated)
    _, sec = codec._sections(enc.payload, enc.shape, codec._counts(enc.shape))  # type: ignore[attr-defined]
    bits = torch.from_numpy(sec["kbits"].astype(np.int64))  # (L, H, D), 2..8, 4 on average
    assert int(bits.min()) >= 2 and int(bits.max()) <= 8
    assert (bits.sum(dim=(1, 2)) == 4 * k.shape[1] * k.shape[3]).all()
    levels = (2.0 ** bits - 1)[:, :, None, :]
    for g0 in range(4, 284, 32):  # each channel: half a step of its own width over the group range
        sl = slice(g0, min(284, g0 + 32))
        step = _row_range(k[:, :, sl], (2,)) / levels
        assert ((ko[:, :, sl] - k[:, :, sl]).abs() <= step * 0.51 + k[:, :, sl].abs() * 1e-3 + 1e-4).all()
    step = _row_range(v[:, :, mid], (3,)) / 15  # V rows are 4 or 8 bits (v_low = 0)
    assert ((vo[:, :, mid] - v[:, :, mid]).abs() <= step * 0.51 + 1e-4).all()
    # the widest-range K channels (the outliers 0..3) get the most bits
    assert (bits[..., :4].float().mean() > bits[..., 4:].float().mean() + 1).item()


def test_mixed_bits_follow_query_weights() -> None:
    from kvport.codec.mixed import allocate_bits

    w = np.ones((1, 2, 8))
    w[0, 1, 3] = 1e6  # one channel whose error matters most
    bits = allocate_bits(w, 4 * 16)
    assert bits.sum() == 64 and bits[0, 1, 3] == 8 and bits.min() >= 2
    assert (allocate_bits(np.zeros((2, 1, 4)), 2 * 4) == 2).all()
    assert (allocate_bits(np.ones((2, 1, 4)), 8 * 4) == 8).all()


def test_mixed_target_ratio_is_met_and_importance_steers_v() -> None:
    k, v = kv(layers=2, tokens=1024, dtype=torch.bfloat16)
    c = get_codec("mixed", target_ratio=3.3)
    enc = c.encode(k, v)
    assert enc.ratio >= 3.3
    assert c.encoded_size(enc.shape) == enc.nbytes
    # importance names tokens 100..109 as the most important: their V is then stored at 8 bits
    imp = torch.zeros(1024)
    imp[100:110] = 1.0
    c2 = get_codec("mixed", v_top=0.01, target_ratio=None, v_rotate=False)  # bound below: unrotated rows
    enc2 = c2.encode(k, v, importance=imp)
    ko, vo = torch.empty_like(k), torch.empty_like(v)
    c2.decode(enc2, ko, vo)
    rows = v[:, :, 100:110].float()
    err = (vo[:, :, 100:110].float() - rows).abs()
    rng = rows.amax(-1, keepdim=True).clamp(min=0) - rows.amin(-1, keepdim=True).clamp(max=0)
    assert (err <= rng / 255 * 1.01 + rows.abs() * 2**-8 + 1e-4).all()


@pytest.mark.parametrize("codec_id", ["int8", "kivi4", "mixed"])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_short_ranges_round_trip(codec_id: str, tokens: int) -> None:
    k, v = kv(tokens=tokens, dtype=torch.float32)
    ko, vo, _ = _roundtrip(codec_id, k, v)
    assert torch.isfinite(ko).all() and torch.isfinite(vo).all()
    assert (ko - k).abs().max() < 0.5 * (k.abs().max() + 1)


def test_encode_into_caller_buffer_leaves_the_rest_untouched() -> None:
    k, v = kv()
    c = get_codec("kivi4")
    cap = c.max_encoded_size(KVShape(*k.shape, DType.BF16))  # type: ignore[arg-type]
    buf = np.full(cap + 64, 0xAB, np.uint8)
    enc = c.encode(k, v, out=buf[:cap])
    assert np.shares_memory(enc.payload, buf)
    assert (buf[cap:] == 0xAB).all()


def test_decode_writes_only_its_destination_view() -> None:
    k, v = kv(tokens=20)
    for codec_id in codec_ids():
        c = get_codec(codec_id)
        enc = c.encode(k, v)
        big_k = torch.full((2, 3, 24, 64), 7.0, dtype=torch.bfloat16)
        big_v = torch.full((2, 3, 24, 64), 7.0, dtype=torch.bfloat16)
        c.decode(enc, big_k[:, :, 2:22], big_v[:, :, 2:22])
        for big in (big_k, big_v):
            assert (big[:, :, :2] == 7.0).all() and (big[:, :, 22:] == 7.0).all(), codec_id


def test_codec_identity_travels_as_msgpack_and_in_keys() -> None:
    ctx_keys = set()
    for codec_id in codec_ids():
        c = get_codec(codec_id)
        d = msgpack.unpackb(msgpack.packb(codec_to_dict(c)), raw=False)
        again = codec_from_dict(d)
        assert (again.codec_id, again.params) == (c.codec_id, c.params)
        ctx_keys.add(chain_keys(np.arange(16), KeyContext(block_size=16, codec_id=codec_key(c)))[0])
    assert len(ctx_keys) == len(codec_ids())
    assert codec_key(get_codec("kivi4", group=128)) != codec_key(get_codec("kivi4"))


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _unrope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Keys turned back by their rotary angle (half-split layout, positions 0.. along the tokens)."""
    d = x.shape[-1]
    ang = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2) / d)
    cs, sn = ang.cos().float(), ang.sin().float()
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cs + b * sn, b * cs - a * sn], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_rotations_are_exact_inverses_and_quantize_in_the_rotated_domain(dtype: torch.dtype) -> None:
    """With both rotations on, the middle tokens' error is bounded by the quantizer's step *in the
    rotated domain* (K before rotary embedding, V times the Hadamard matrix); the size is unchanged."""
    k, v = kv(tokens=300, dtype=torch.float32)
    params = {"sinks": 4, "recent": 0, "group": 32, "k_bits": 4, "calib": None, "k_rope_theta": 100000.0,
              "v_rotate": True}
    ko, vo, enc = _roundtrip("mixed", k.to(dtype), v.to(dtype), **params)
    assert enc.nbytes == get_codec("mixed", **{**params, "k_rope_theta": None, "v_rotate": False}).encoded_size(
        enc.shape)
    codec = get_codec("mixed", **params)
    _, sec = codec._sections(enc.payload, enc.shape, codec._counts(enc.shape))  # type: ignore[attr-defined]
    levels = (2.0 ** torch.from_numpy(sec["kbits"].astype(np.int64)) - 1)[:, :, None, :]
    kin, kr = _unrope(k[:, :, 4:].to(dtype).float(), 1e5), _unrope(ko[:, :, 4:].float(), 1e5)
    slack = 2e-2 if dtype is not torch.float32 else 1e-3  # bf16/fp16 rounding of the input and output
    for g0 in range(0, 296, 32):
        sl = slice(g0, min(296, g0 + 32))
        step = _row_range(kin[:, :, sl], (2,)) / levels
        assert ((kr[:, :, sl] - kin[:, :, sl]).abs() <= step * 0.51 + kin[:, :, sl].abs() * slack + 1e-4).all()
    h = _hadamard(64)
    vin, vr = v[:, :, 4:].to(dtype).float() @ h, vo[:, :, 4:].float() @ h
    step = _row_range(vin, (3,)) / 15
    assert ((vr - vin).abs() <= step * 0.51 + vin.abs() * slack + 1e-4).all()
    # the sinks are stored as int8 rows, unrotated
    assert ((ko[:, :, :4].float() - k[:, :, :4].to(dtype).float()).abs() <= _row_range(k[:, :, :4], (3,)) / 255 * 1.01
            + 2e-2).all()


def test_mixed_rotations_are_the_default_and_travel_in_the_params() -> None:
    assert get_codec("mixed").params["k_rope_theta"] == 100000.0 and get_codec("mixed").params["v_rotate"] is True
    k, v = kv(tokens=64)
    c = get_codec("mixed", k_rope_theta=10000.0, v_rotate=True)
    assert codec_from_dict(codec_to_dict(c)).params == c.params
    assert codec_key(c) != codec_key(get_codec("mixed"))
    assert codec_key(get_codec("mixed", k_rope_theta=None, v_rotate=False)) != codec_key(get_codec("mixed"))
    enc = c.encode(k, v)
    # the payload and its params are all a decoder needs: a fresh codec built from them decodes it equally
    ko1, vo1, ko2, vo2 = (torch.empty_like(k) for _ in range(4))
    c.decode(enc, ko1, vo1)
    get_codec("mixed", **dict(enc.params)).decode(enc, ko2, vo2)
    assert torch.equal(ko1, ko2) and torch.equal(vo1, vo2)


@pytest.mark.parametrize("params", [{"k_rope_theta": 100000.0, "v_rotate": True},
                                    {"k_rope_theta": None, "v_rotate": False, "group": 32, "v_top": 0.1,
                                     "v_low": 0.2, "recent": 5}])
def test_mixed_sections_do_not_depend_on_the_callers_buffer(params: dict[str, object]) -> None:
    """K code streams are written 8 bytes at a time (a chunk's write spills into its channel's later
    chunks, rewritten after it): every section is a function of the input alone, whatever the
    caller's buffer held before, and so is the decoded output (encode and decode are deterministic)."""
    k, v = kv(layers=3, tokens=203, dtype=torch.bfloat16)
    c = get_codec("mixed", **params)
    cap = c.max_encoded_size(KVShape(3, 3, 203, 64, DType.BF16))
    secs: list[dict[str, np.ndarray]] = []
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for fill in (0x00, 0xFF, 0x5A):
        enc = c.encode(k, v, out=np.full(cap, fill, np.uint8))
        secs.append(c._sections(enc.payload, enc.shape, c._counts(enc.shape))[1])  # type: ignore[attr-defined]
        ko, vo = torch.empty_like(k), torch.empty_like(v)
        c.decode(enc, ko, vo)
        outs.append((ko, vo))
    for sec in secs[1:]:
        for name, arr in sec.items():
            assert np.array_equal(arr, secs[0][name]), name
    for ko, vo in outs[1:]:
        assert torch.equal(ko, outs[0][0]) and torch.equal(vo, outs[0][1])


@pytest.mark.parametrize("D", [8, 64, 128, 256])  # the Hadamard in registers up to 128, in a loop above
def test_mixed_payload_layout_matches_a_plain_reference(D: int) -> None:
    """The layout drawn in kvport.codec.mixed, read back with numpy alone (K: per (layer, head,
    channel) a little-endian stream of ``bits``-bit codes along tokens; V: 4-bit rows, low nibble =
    even dim), then the inverse rotations in float64: equals what the kernels decode."""
    L, H, T, sinks, recent, group = 2, 3, 203, 4, 3, 32
    k, v = kv(layers=L, heads=H, tokens=T, dim=D, dtype=torch.float32)
    c = get_codec("mixed", group=group, sinks=sinks, recent=recent, k_rope_theta=100000.0, v_rotate=True)
    enc = c.encode(k, v)
    ko, vo = torch.empty_like(k), torch.empty_like(v)
    c.decode(enc, ko, vo)
    _, sec = c._sections(enc.payload, enc.shape, c._counts(enc.shape))  # type: ignore[attr-defined]
    m = T - sinks - recent
    chunks, grp = (m + 7) // 8, np.arange(m) // group
    bits = sec["kbits"].astype(np.int64)
    ks, kz = sec["ks"].astype(np.float64), sec["kz"].astype(np.float64)
    kmid = np.empty((L, H, m, D))
    for li in range(L):
        off = 0
        for h in range(H):
            for d in range(D):
                nb = int(bits[li, h, d])
                stream = np.unpackbits(sec["kq"][li, off:off + chunks * nb], bitorder="little")
                off += chunks * nb
                codes = (stream.reshape(-1, nb).astype(np.int64) << np.arange(nb)).sum(1)[:m]
                kmid[li, h, :, d] = codes * ks[li, h, grp, d] + kz[li, h, grp, d]
    ang = np.arange(m)[:, None] * 100000.0 ** (-np.arange(0, D, 2) / D)
    cs, sn = np.cos(ang), np.sin(ang)
    a, b = kmid[..., :D // 2], kmid[..., D // 2:]
    kref = np.concatenate([a * cs - b * sn, b * cs + a * sn], -1)  # turned forward again
    assert np.abs(ko[:, :, sinks:T - recent].numpy() - kref).max() <= 1e-5 * np.abs(kref).max()
    assert (sec["vcls"] == 0).all()  # v_top = v_low = 0: every middle row at 4 bits, slot = token
    nib = sec["v4"].astype(np.int64)
    codes = np.stack([nib & 15, nib >> 4], -1).reshape(L, H, m, D)
    vmid = codes * sec["v4s"].astype(np.float64)[..., None] + sec["v4z"].astype(np.float64)[..., None]
    vref = vmid @ _hadamard(D).double().numpy()
    assert np.abs(vo[:, :, sinks:T - recent].numpy() - vref).max() <= 1e-5 * np.abs(vref).max()

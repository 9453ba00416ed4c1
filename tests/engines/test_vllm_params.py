"""The hand-off's ``kv_transfer_params``: byte for byte what kvport always sent, and every bad input
refused by its parser with an error that says what is wrong."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvport.engines.vllm.params import DEST_KEY, MAX_TOKENS, HandoffAnswer, HandoffAsk, is_stream_id, new_stream_id
from kvport.errors import (
    HandoffNotSentError,
    HandoffParamsError,
    HandoffUnreadableError,
    HandoffVersionError,
    ProtocolError,
)
from kvport.spec import DType, KVSpec, Layout

SPEC = KVSpec("m", num_layers=3, num_kv_heads=2, head_dim=8, dtype=DType.FP32, block_size=4, layout=Layout.VLLM_CPU)
SID = "0123456789abcdef0123456789abcdef"
KEY = "00112233445566778899aabbccddeeff"


def _answer(**kv: Any) -> dict[str, Any]:
    out = HandoffAnswer(tokens=64, last_key=KEY, spec=SPEC, engine="kv_producer:p0", lease_s=30.0,
                        stream=SID).to_params()
    out["kvport"].update(kv)
    return out


def test_the_ask_is_the_wire_format_kvport_always_sent() -> None:
    assert HandoffAsk().to_params() == {"do_remote_decode": True}
    assert json.dumps(HandoffAsk("127.0.0.1:9300").to_params()) == \
        '{"do_remote_decode": true, "kvport_dest": "127.0.0.1:9300"}'
    shm = "shm:kvport-inbox-1"
    assert HandoffAsk.parse({"do_remote_decode": True, DEST_KEY: shm}) == HandoffAsk(shm)
    assert HandoffAsk.parse({"do_remote_decode": True}) == HandoffAsk()


@pytest.mark.parametrize("params", [None, [], {}, {"do_remote_decode": False}, {"do_remote_prefill": True}])
def test_no_ask_is_never_sent(params: object) -> None:
    with pytest.raises(HandoffNotSentError):
        HandoffAsk.parse(params)


@pytest.mark.parametrize("dest", ["nohost", "h:0", "h:70000", ":9", "shm:", "shm:a/b", 9300, ["h:1"], "h:" + "1" * 400])
def test_an_ask_with_a_bad_destination_is_unreadable(dest: object) -> None:
    with pytest.raises(HandoffUnreadableError, match=DEST_KEY):
        HandoffAsk.parse({"do_remote_decode": True, DEST_KEY: dest})
    if isinstance(dest, str):
        with pytest.raises(HandoffUnreadableError):
            HandoffAsk(dest)


def test_the_answer_is_the_wire_format_kvport_always_sent() -> None:
    params = HandoffAnswer(tokens=64, last_key=KEY, spec=SPEC, engine="kv_producer:p0", lease_s=30.0,
                           stream=None).to_params()
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "kvport": {"v": 1, "tokens": 64, "last_key": KEY, "spec": SPEC.as_dict(),
                                 "engine": "kv_producer:p0", "lease_s": 30.0, "stream": None}}
    assert list(params) == ["do_remote_prefill", "do_remote_decode", "kvport"]
    assert list(params["kvport"]) == ["v", "tokens", "last_key", "spec", "engine", "lease_s", "stream"]
    back = json.loads(json.dumps(params))  # what vLLM and the proxy carry
    assert HandoffAnswer.parse(back) == HandoffAnswer(64, KEY, SPEC, "kv_producer:p0", 30.0, None)
    assert HandoffAnswer.parse(json.loads(json.dumps(_answer(lease_s=None, last_key=None)))).stream == SID


def test_a_spec_of_another_engine_parses_for_the_decode_engine_to_compare() -> None:
    got = HandoffAnswer.parse(_answer(spec={**SPEC.as_dict(), "block_size": 16}))
    assert SPEC.first_mismatch(got.spec) == ("block_size", 4, 16)


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": True}, {"kvport": None}, {"kvport": [1]}])
def test_params_without_kvports_hand_off_were_never_sent(params: object) -> None:
    with pytest.raises(HandoffNotSentError, match="the KV was never sent"):
        HandoffAnswer.parse(params)


@pytest.mark.parametrize("v", [None, 0, 2, "1", 1.5, True])
def test_another_version_is_refused(v: object) -> None:
    with pytest.raises(HandoffVersionError, match="version"):
        HandoffAnswer.parse(_answer(v=v))


@pytest.mark.parametrize(("field", "value"), [
    ("tokens", -1), ("tokens", MAX_TOKENS + 1), ("tokens", "64"), ("tokens", 64.0), ("tokens", True), ("tokens", None),
    ("last_key", "zz"), ("last_key", KEY[:-2]), ("last_key", KEY * 100), ("last_key", 7),
    ("spec", "m"), ("spec", {"model_id": "m"}), ("spec", {**SPEC.as_dict(), "dtype": "fp7"}),
    ("spec", {**SPEC.as_dict(), "extra": 1}), ("spec", {str(i): i for i in range(100)}),
    ("engine", 5), ("engine", "x" * 1000),
    ("lease_s", -1.0), ("lease_s", float("inf")), ("lease_s", float("nan")), ("lease_s", "30"), ("lease_s", 1e12),
    ("stream", SID.upper()), ("stream", SID + "0"), ("stream", SID[:-1]), ("stream", 1), ("stream", "x" * 10**6),
])
def test_an_unreadable_field_is_named(field: str, value: object) -> None:
    with pytest.raises(HandoffUnreadableError, match=field) as err:
        HandoffAnswer.parse(_answer(**{field: value}))
    assert len(str(err.value)) < 400  # a client's bytes are never echoed at length


@pytest.mark.parametrize("field", ["tokens", "spec"])
def test_a_missing_field_is_unreadable(field: str) -> None:
    params = _answer()
    del params["kvport"][field]
    with pytest.raises(HandoffUnreadableError, match=field):
        HandoffAnswer.parse(params)


def test_the_errors_are_protocol_errors_of_one_branch() -> None:
    for cls in (HandoffNotSentError, HandoffVersionError, HandoffUnreadableError):
        assert issubclass(cls, HandoffParamsError)
    assert issubclass(HandoffParamsError, ProtocolError)


def test_stream_ids() -> None:
    sid = new_stream_id()
    assert is_stream_id(sid) and len(sid) == 32 and sid != new_stream_id()
    assert not is_stream_id(sid.upper()) and not is_stream_id(None) and not is_stream_id(sid + "a")


def test_an_ask_names_one_inbox_per_decode_rank() -> None:
    three = "10.0.0.2:9300,10.0.0.2:9301,shm:kvport-inbox-2"
    ask = HandoffAsk.parse({"do_remote_decode": True, DEST_KEY: three})
    assert ask == HandoffAsk(three) and ask.dests == ("10.0.0.2:9300", "10.0.0.2:9301", "shm:kvport-inbox-2")
    assert HandoffAsk("h:1").dests == ("h:1",) and HandoffAsk().dests == ()
    for bad in ("h:1,", ",h:1", "h:1,,h:2", "h:1,nohost", ",".join(["h:1"] * 65)):
        with pytest.raises(HandoffUnreadableError, match="one per rank"):
            HandoffAsk.parse({"do_remote_decode": True, DEST_KEY: bad})

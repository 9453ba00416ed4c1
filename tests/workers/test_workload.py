"""The chat workload: every turn extends the previous one token for token (what makes its KV reusable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvport.errors import ConfigError
from kvport.workers.workload import Conversation, default_workload


def test_turns_extend_each_other_and_share_the_system_prompt(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    wl = default_workload(users=2, rounds=2, max_new_tokens=4)
    a, b = (Conversation(tok, wl.system, eos_id=2) for _ in range(2))
    pa, pb = a.prompt(wl.questions[0][0]), b.prompt(wl.questions[1][0])
    shared = a.shared_prefix_tokens()
    assert shared > 64 and pa[:shared] == pb[:shared] and pa[shared] == pb[shared]  # <|im_start|>user
    a.commit(pa, [42, 43])  # cut off: the turn is closed with <|im_end|>
    assert a.tokens == [*pa, 42, 43, 2]
    nxt = a.prompt(wl.questions[0][1])
    assert nxt[: len(a.tokens)] == a.tokens and len(nxt) > len(a.tokens)
    a.commit(nxt, [7, 2])  # ended by the model: nothing added
    assert a.tokens == [*nxt, 7, 2]


def test_workload_sizes_are_checked() -> None:
    assert default_workload(3, 3).users == 3 and default_workload(3, 3).rounds == 3
    with pytest.raises(ConfigError):
        default_workload(users=9)

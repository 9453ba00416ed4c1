"""The demo's sessions: every turn extends the previous one token for token (what makes its KV reusable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvport.errors import ConfigError
from kvport.workers.workload import Conversation, SessionKind, default_workload


def test_turns_extend_each_other_and_agents_share_the_tool_prompt(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    wl = default_workload(users=3, rounds=2, max_new_tokens=4)
    chat, agent_a, agent_b = wl.sessions
    assert (chat.kind, agent_a.kind, agent_b.kind) == (SessionKind.CHAT, SessionKind.AGENT, SessionKind.AGENT)
    a, b = (Conversation(tok, s.system, eos_id=2) for s in (agent_a, agent_b))
    pa, pb = a.prompt(agent_a.turns[0]), b.prompt(agent_b.turns[0])
    shared = a.shared_prefix_tokens()
    assert shared > 1500 and pa[:shared] == pb[:shared] and pa[shared] == pb[shared]  # <|im_start|>user
    a.commit(pa, [42, 43])  # cut off: the turn is closed with <|im_end|>
    assert a.tokens == [*pa, 42, 43, 2]
    nxt = a.prompt(agent_a.turns[1])  # a tool result
    assert nxt[: len(a.tokens)] == a.tokens and len(nxt) > len(a.tokens)
    a.commit(nxt, [7, 2])  # ended by the model: nothing added
    assert a.tokens == [*nxt, 7, 2]
    c = Conversation(tok, chat.system, eos_id=2)
    first = c.prompt(chat.turns[0])  # the pasted log: the history is long from the first turn
    assert len(first) > 2000

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    c.commit(first, [5] * 4)
    second = c.prompt(chat.turns[1])
    assert wl.token_bounds(count)[0] >= len(second) + 4 + 1  # a bound on the session after round 2


def test_workload_sizes_are_checked_and_excerpts_cut_whole_lines() -> None:
    assert default_workload(3, 3).users == 3 and default_workload(3, 3).rounds == 3
    assert [s.name for s in default_workload(4, 4).sessions] == ["chat-log", "agent-backup", "agent-upload",
                                                                 "chat-code"]
    small, full = default_workload(2, 1, excerpt_lines=4), default_workload(2, 1)
    assert len(small.sessions[0].turns[0]) < len(full.sessions[0].turns[0]) // 5
    assert len(small.sessions[1].system.splitlines()) == 4
    for bad in ({"users": 9}, {"rounds": 0}, {"max_new_tokens": 0}, {"excerpt_lines": 0}):
        with pytest.raises(ConfigError):
            default_workload(**bad)  # type: ignore[arg-type]

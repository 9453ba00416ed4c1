"""The workloads of the demo and the fault benchmark: sessions of several rounds, built token by token.

Turns are built at the token level, the way a serving engine keeps a session::

    turn 1   prompt = chat_template(system, message 1, generation prompt)
    turn n+1 prompt = prompt(n) + answer(n) [+ <|im_end|> if cut off]
                      + "\\n<|im_start|>user\\n" message(n+1) "<|im_end|>\\n<|im_start|>assistant\\n"

so turn n+1 extends turn n's tokens exactly and its KV is reusable block for block. The first
``shared_prefix_tokens`` tokens (the rendered system prompt) are the same for every session with
that system prompt.

The demo's workload (:func:`default_workload`, texts in :mod:`kvport.workers.material`) holds
sessions of two kinds, each growing to 2-4k tokens of history::

    session        system prompt (tokens)     turn 1                      turns 2..4
    chat-log       engineering assistant (60) an incident log (~2.0k)    short questions
    agent-backup   tool catalogue (~2.0k)     a task                      tool results (~90-120)
    agent-upload   the same tool catalogue    a task                      tool results (~100-220)
    chat-code      engineering assistant      a module and its tests (~2k) short questions

The two agent sessions share their system prompt: the second finds the first's blocks of it.
The fault benchmark's chats use :data:`SYSTEM_PROMPT` (a short support assistant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

from kvport.errors import ConfigError
from kvport.workers import material as m

SYSTEM_PROMPT = (
    "You are Kestrel, the support assistant of a small company that runs a cloud service for storing "
    "and sharing photos. Answer in one or two short sentences. Be friendly and precise. If a question "
    "is about billing, say that plans start at five dollars a month and can be cancelled at any time. "
    "If a question is about privacy, say that photos are private unless the owner shares a link. If a "
    "question is about storage, say that every plan includes one hundred gigabytes and more can be "
    "added. Never invent features. If you do not know the answer, say so and suggest writing to the "
    "support team by email. Do not use lists or headings."
)

_TURN = "\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
_TEMPLATE_TOKENS = 16  # a bound on the chat template's tokens around one message (role, markers)


class SessionKind(Enum):
    CHAT = "chat"  # a user pastes a document, then asks about it
    AGENT = "agent"  # a tool catalogue as the system prompt, a task, then tool results


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    kind: SessionKind
    system: str
    turns: tuple[str, ...]  # the message of each round: a document or a task first, then questions or results


@dataclass(frozen=True, slots=True)
class Workload:
    sessions: tuple[Session, ...]
    max_new_tokens: int

    @property
    def users(self) -> int:
        return len(self.sessions)

    @property
    def rounds(self) -> int:
        return min(len(s.turns) for s in self.sessions)

    def token_bounds(self, n_tokens: Callable[[str], int]) -> tuple[int, ...]:
        """Per session, an upper bound on its tokens after the last round (prompt + answer), with
        ``n_tokens`` counting a text's tokens: what the receive buffer and the shared tier are sized by."""
        per_turn = _TEMPLATE_TOKENS + self.max_new_tokens + 1
        return tuple(n_tokens(s.system) + _TEMPLATE_TOKENS
                     + sum(n_tokens(t) + per_turn for t in s.turns[: self.rounds]) for s in self.sessions)


def _excerpt(text: str, lines: int | None) -> str:
    """The first ``lines`` lines of ``text`` (all when None): a smaller workload cuts whole lines."""
    if lines is None:
        return text
    return "\n".join(text.split("\n")[:lines]).rstrip("\n") + "\n"


def _sessions(excerpt_lines: int | None) -> tuple[Session, ...]:
    cut = partial(_excerpt, lines=excerpt_lines)
    tools = cut(m.TOOL_PROMPT)
    return (
        Session("chat-log", SessionKind.CHAT, m.CHAT_SYSTEM,
                ("Here is the log of last night's incident INC-2291 in our upload service:\n\n"
                 + cut(m.INCIDENT_LOG) + "\nWhat was the root cause?", *m.CHAT_LOG_QUESTIONS[:3])),
        Session("agent-backup", SessionKind.AGENT, tools, (m.BACKUP_TASK, *m.BACKUP_RESULTS[:3])),
        Session("agent-upload", SessionKind.AGENT, tools, (m.UPLOAD_TASK, *m.UPLOAD_RESULTS[:3])),
        Session("chat-code", SessionKind.CHAT, m.CHAT_SYSTEM,
                ("Here is our storage quota module, quota.py, and its tests, test_quota.py:\n\n```python\n"
                 + cut(m.QUOTA_MODULE) + "```\n\n```python\n" + cut(m.QUOTA_TESTS)
                 + "```\n\nWhat does reserve() do?", *m.CHAT_CODE_QUESTIONS[:3])),
    )


MAX_USERS, MAX_ROUNDS = 4, 4


def default_workload(users: int = 3, rounds: int = 3, max_new_tokens: int = 12,
                     excerpt_lines: int | None = None) -> Workload:
    """The demo's sessions: the first ``users`` of chat-log, agent-backup, agent-upload, chat-code,
    ``rounds`` rounds each; ``excerpt_lines`` cuts every pasted text and the tool catalogue to its
    first lines (a small variant for tests; None: the full texts, histories of 2-4k tokens)."""
    if not 1 <= users <= MAX_USERS or not 1 <= rounds <= MAX_ROUNDS:
        raise ConfigError(f"users must be in 1..{MAX_USERS}, rounds in 1..{MAX_ROUNDS}")
    if max_new_tokens < 1 or (excerpt_lines is not None and excerpt_lines < 1):
        raise ConfigError(f"max_new_tokens and excerpt_lines must be positive, got {max_new_tokens}, {excerpt_lines}")
    sessions = tuple(Session(s.name, s.kind, s.system, s.turns[:rounds]) for s in _sessions(excerpt_lines)[:users])
    return Workload(sessions, max_new_tokens)


class Conversation:
    """Token-level chat history of one user (see the module docstring)."""

    def __init__(self, tokenizer: Any, system: str, eos_id: int) -> None:
        self.tok = tokenizer
        self.system = system
        self.eos_id = eos_id
        self.tokens: list[int] = []

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.tok(text, add_special_tokens=False)["input_ids"]
        return ids

    def shared_prefix_tokens(self) -> int:
        msgs = [{"role": "system", "content": self.system}]
        sys_ids = self.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)["input_ids"]
        return len(sys_ids)

    def prompt(self, question: str) -> list[int]:
        """The next prompt: the history so far plus this question (the history is not changed)."""
        if not self.tokens:
            msgs = [{"role": "system", "content": self.system}, {"role": "user", "content": question}]
            ids: list[int] = list(self.tok.apply_chat_template(msgs, tokenize=True,
                                                               add_generation_prompt=True)["input_ids"])
            return ids
        return self.tokens + self._encode(_TURN.format(q=question))

    def commit(self, prompt: list[int], answer: list[int]) -> None:
        """Record the answer: the history becomes prompt + answer (+ end-of-turn if it was cut off)."""
        self.tokens = list(prompt) + list(answer) + ([] if answer and answer[-1] == self.eos_id else [self.eos_id])

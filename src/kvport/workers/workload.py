"""The chat workload of the demo and the fault benchmark: one shared system prompt, several users, several rounds each.

Turns are built at the token level, the way a serving engine keeps a session::

    turn 1   prompt = chat_template(system, question 1, generation prompt)
    turn n+1 prompt = prompt(n) + answer(n) [+ <|im_end|> if cut off]
                      + "\\n<|im_start|>user\\n" question(n+1) "<|im_end|>\\n<|im_start|>assistant\\n"

so turn n+1 extends turn n's tokens exactly and its KV is reusable block for block. The first
``shared_prefix_tokens`` tokens (the rendered system prompt) are the same for every user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvport.errors import ConfigError

SYSTEM_PROMPT = (
    "You are Kestrel, the support assistant of a small company that runs a cloud service for storing "
    "and sharing photos. Answer in one or two short sentences. Be friendly and precise. If a question "
    "is about billing, say that plans start at five dollars a month and can be cancelled at any time. "
    "If a question is about privacy, say that photos are private unless the owner shares a link. If a "
    "question is about storage, say that every plan includes one hundred gigabytes and more can be "
    "added. Never invent features. If you do not know the answer, say so and suggest writing to the "
    "support team by email. Do not use lists or headings."
)

QUESTIONS: tuple[tuple[str, ...], ...] = (
    ("How much does the service cost?", "Can I cancel later?", "Is there a family plan?", "Thanks, bye!"),
    ("Are my photos private?", "What happens when I share a link?", "Can I revoke it?", "Great, thank you."),
    ("How much storage do I get?", "Can I buy more?", "What if I run out?", "Understood."),
    ("Do you have a mobile app?", "Does it back up automatically?", "Does it use mobile data?", "Okay, thanks."),
)

_TURN = "\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True, slots=True)
class Workload:
    system: str
    questions: tuple[tuple[str, ...], ...]  # questions[user][round]
    max_new_tokens: int

    @property
    def users(self) -> int:
        return len(self.questions)

    @property
    def rounds(self) -> int:
        return min(len(q) for q in self.questions)


def default_workload(users: int = 3, rounds: int = 3, max_new_tokens: int = 24) -> Workload:
    if not 1 <= users <= len(QUESTIONS) or not 1 <= rounds <= len(QUESTIONS[0]):
        raise ConfigError(f"users must be in 1..{len(QUESTIONS)}, rounds in 1..{len(QUESTIONS[0])}")
    return Workload(SYSTEM_PROMPT, tuple(q[:rounds] for q in QUESTIONS[:users]), max_new_tokens)


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

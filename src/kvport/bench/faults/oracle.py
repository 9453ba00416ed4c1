"""The fault benchmark's chats and its oracle: every request's answer computed once without kvport.

A chat is one user's conversation on the reference model (the demo's system prompt, then a question
with a few sentences of context, 100-600 tokens); turn 2 extends turn 1's prompt and expected answer
at the token level (:class:`kvport.workers.workload.Conversation`), so its KV is reusable block for block::

    turn 1   chat_template(system, question 1 + context)                   -> answer 1 (oracle)
    turn 2   turn 1 + answer 1 + <|im_start|>user question 2 + context ... -> answer 2 (oracle)

The oracle is plain transformers in this process (a model instance of its own that kvport never
touched): one forward over the whole prompt, then one token at a time on a ``DynamicCache``; greedy;
for each generated token the log-softmax of the chosen token (fp32) and the gap to the runner-up.
A chat whose smallest gap is below :data:`MIN_MARGIN` is drawn again: there a float-noise tie could
flip a token with or without kvport, and the benchmark would blame the wrong thing.

:func:`compare` is the check every request of the benchmark gets: the same tokens, and every
logprob within :data:`TOLERANCE`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvport.workers.workload import SYSTEM_PROMPT, Conversation

TOLERANCE = 1e-4  # |logprob(kvport) - logprob(oracle)| allowed per token (fp32 both sides)
MIN_MARGIN = 1e-3  # top-1 minus top-2 logprob below which a chat is not used (a near tie)

_SENTENCES = (
    "The photo library grew to twelve thousand pictures over the last three years.",
    "Most of them were taken on a phone and uploaded from the mobile app at night.",
    "Last week the upload of a long video stopped at ninety percent and never finished.",
    "A shared album with the family holds the pictures from the summer trip to the coast.",
    "Someone outside the family asked for the link, and I am not sure it should be shared.",
    "The invoice for this month was higher than the one for the month before.",
    "I changed the plan in spring, but the receipt still shows the old plan's name.",
    "The desktop client says the disk is full although the account has space left.",
    "Two devices show different numbers of photos in the same album.",
    "My sister cannot open the album from her tablet, but she can from her laptop.",
    "The backup setting was switched off after the last update of the phone.",
    "Some pictures from the trip appear twice, once with the original name and once renamed.",
    "I would like to download everything as one archive before the end of the year.",
    "The search finds pictures of the beach but not the ones of the harbour.",
    "A friend recommended the service because it keeps the original resolution.",
    "I travel a lot and often have only a slow connection in the evening.",
)
_QUESTIONS = (
    "Why did this happen?", "What should I do now?", "Is this expected?", "How can I fix it?",
    "Can you explain what went wrong?", "Will I lose any pictures?", "Does my plan cover this?",
)


@dataclass(frozen=True, slots=True)
class Expected:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    margin: float  # the smallest top-1 minus top-2 logprob over the generated tokens


@dataclass(frozen=True, slots=True)
class Chat:
    cid: str
    prompts: tuple[tuple[int, ...], ...]  # turn by turn
    expected: tuple[Expected, ...]


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    tokens_equal: bool
    max_logprob_diff: float | None  # None when the token lists differ in length or logprobs are missing
    detail: str = ""


def compare(exp: Expected, tokens: list[int], logprobs: list[float] | None) -> Verdict:
    """The benchmark's check of one answer against the oracle's."""
    if list(exp.tokens) != list(tokens):
        return Verdict(False, False, None, f"tokens {tokens} != oracle {list(exp.tokens)}")
    if logprobs is None or len(logprobs) != len(exp.logprobs):
        return Verdict(False, True, None, f"{0 if logprobs is None else len(logprobs)} logprobs for "
                                          f"{len(exp.logprobs)} tokens")
    diff = max((abs(a - b) for a, b in zip(logprobs, exp.logprobs, strict=True)), default=0.0)
    return Verdict(diff <= TOLERANCE, True, diff, "" if diff <= TOLERANCE else f"logprob off by {diff:.2e}")


class Oracle:
    """Plain transformers, no kvport: the answers every request of the benchmark must give."""

    def __init__(self, model_dir: Path, max_new: int, threads: int = 1) -> None:
        from kvport.refmodel import load

        torch.set_num_threads(threads)
        self.model, self.tok = load(model_dir, prepare_if_missing=False)
        self.max_new = max_new
        eos = self.model.generation_config.eos_token_id
        self.eos = frozenset([eos] if isinstance(eos, int) else list(eos or []))
        self.eos_id = min(self.eos) if self.eos else 2
        self.shared_prefix_tokens = Conversation(self.tok, SYSTEM_PROMPT, self.eos_id).shared_prefix_tokens()

    def answer(self, prompt: tuple[int, ...]) -> Expected:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt], dtype=torch.long)
        tokens: list[int] = []
        lps: list[float] = []
        margin = float("inf")
        with torch.inference_mode():
            while True:
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                top = torch.topk(lp, 2)
                t = int(top.indices[0])
                tokens.append(t)
                lps.append(float(top.values[0]))
                margin = min(margin, float(top.values[0] - top.values[1]))
                if len(tokens) >= self.max_new or t in self.eos:
                    break
                ids = torch.tensor([[t]], dtype=torch.long)
        return Expected(tuple(tokens), tuple(lps), margin)

    def _question(self, rng: random.Random, target_tokens: int) -> str:
        text = rng.choice(_QUESTIONS)
        parts: list[str] = []
        while len(self.tok(" ".join(parts), add_special_tokens=False)["input_ids"]) < target_tokens:
            parts.append(rng.choice(_SENTENCES))
        return " ".join(parts) + " " + text

    def chat(self, cid: str, seed: int, turns: int, lengths: tuple[int, int], tries: int = 8) -> Chat:
        """A chat of ``turns`` turns whose first prompt is about ``lengths[0]``..``lengths[1]`` tokens
        (turn 2 adds up to a third of that), with its expected answers; redrawn on a near tie."""
        rng = random.Random(seed)
        last: Chat | None = None
        for _ in range(tries):
            conv = Conversation(self.tok, SYSTEM_PROMPT, self.eos_id)
            prompts: list[tuple[int, ...]] = []
            expected: list[Expected] = []
            first_len = rng.randint(*lengths)
            for turn in range(turns):
                ctx = max(8, first_len - self.shared_prefix_tokens - 20) if turn == 0 else \
                    rng.randint(8, max(9, first_len // 3))
                prompt = tuple(conv.prompt(self._question(rng, ctx)))
                exp = self.answer(prompt)
                conv.commit(list(prompt), list(exp.tokens))
                prompts.append(prompt)
                expected.append(exp)
            last = Chat(cid, tuple(prompts), tuple(expected))
            if min(e.margin for e in expected) >= MIN_MARGIN:
                return last
        assert last is not None
        return last

    def describe(self) -> dict[str, Any]:
        return {"oracle": "plain transformers (a model instance kvport never touched), full prefill then "
                          "one token at a time on a DynamicCache, greedy, fp32",
                "tolerance_logprob": TOLERANCE, "min_margin_logprob": MIN_MARGIN, "max_new_tokens": self.max_new}

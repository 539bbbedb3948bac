"""The canary: a few fixed prompts, greedy, with each answer token's log-probability, compared with
a reference recorded on a box the operator trusts (same checkpoint and revision).

One copy for every side: the edge's canary runner (system `python3 -I -S`: standard library only),
`donors reference` on the operator's machine, the tests and bench/canary_spread.py. A donor's
answer is untrusted input: parse_answer bounds and checks it before anything reads it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Short, plain prompts of different kinds; each answer is MAX_TOKENS greedy tokens.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "List three primary colors:",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The opposite of hot is",
)
MAX_TOKENS = 8
# An answer of MAX_TOKENS tokens is a few KiB; anything near this is not an answer.
ANSWER_LIMIT = 64 * 1024
TOKEN_LIMIT = 256  # characters in one token's text, as the server writes it


class BadAnswer(ValueError):
    """What a server answered is not a completion of the canary's shape."""


@dataclass(frozen=True)
class Answer:
    model: str
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Score:
    agree: float  # reference tokens the answer matched, in order, before its first difference
    gap: float  # mean |log-probability difference| over those matched tokens
    matched: int
    total: int


def request_body(checkpoint: str, prompt: str, max_tokens: int = MAX_TOKENS) -> bytes:
    """An ordinary greedy completion request, asking for each token's log-probability."""
    return json.dumps({"model": checkpoint, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "logprobs": 1}).encode()


def parse_answer(raw: bytes, max_tokens: int = MAX_TOKENS) -> Answer:
    """The served model, tokens and log-probabilities of an OpenAI completions answer, checked."""
    if len(raw) > ANSWER_LIMIT:
        raise BadAnswer(f"answer over {ANSWER_LIMIT} bytes")
    try:
        doc = json.loads(raw)
        model = doc["model"]
        logprobs = doc["choices"][0]["logprobs"]
        tokens, values = logprobs["tokens"], logprobs["token_logprobs"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BadAnswer(f"not a completion with log-probabilities ({type(exc).__name__})") from None
    if not isinstance(model, str) or not 0 < len(model) <= 200:
        raise BadAnswer("its model is not a short string")
    if not (isinstance(tokens, list) and isinstance(values, list)
            and 0 < len(tokens) == len(values) <= max_tokens):
        raise BadAnswer(f"not 1 to {max_tokens} tokens, each with a log-probability")
    for token, value in zip(tokens, values, strict=True):
        if not isinstance(token, str) or len(token) > TOKEN_LIMIT:
            raise BadAnswer("a token is not a short string")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadAnswer("a log-probability is not a number")
        if not (math.isfinite(value) and value <= 0):
            raise BadAnswer(f"a log-probability of {value!r} (a finite number <= 0 is one)")
    return Answer(model, tuple(tokens), tuple(float(v) for v in values))


def score(reference: Sequence[Answer], answers: Sequence[Answer]) -> Score:
    """How closely the answers follow the reference, prompt by prompt (same order)."""
    if len(reference) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(reference)} reference prompts")
    matched, total, gaps = 0, 0, []
    for ref, got in zip(reference, answers, strict=True):
        total += len(ref.tokens)
        for i, token in enumerate(ref.tokens):
            if i >= len(got.tokens) or got.tokens[i] != token:
                break
            matched += 1
            gaps.append(abs(got.logprobs[i] - ref.logprobs[i]))
    return Score(agree=matched / total if total else 0.0,
                 gap=sum(gaps) / len(gaps) if gaps else math.inf, matched=matched, total=total)


def verdict(result: Score, min_agree: float, max_gap: float) -> str | None:
    """None when the answers pass; else why not, in a few words."""
    if result.agree < min_agree:
        return (f"{result.matched} of {result.total} reference tokens agreed "
                f"({result.agree:.2f} < {min_agree})")
    if result.gap > max_gap:
        return f"log-probabilities {result.gap:.3f} apart on average (> {max_gap})"
    return None

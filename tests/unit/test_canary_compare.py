"""files/canary.py against what the testbed's real vLLM CPU engine answered (issue 35): the
answers bench/canary_spread.py recorded (tests/unit/canary_recorded/, its run of 2026-12-03:
bench/results/canary_spread-2026-12-03.txt) under honest settings pass with the thresholds that
run recommends, a wrong checkpoint's fail; and parse_answer refuses each kind of hostile answer
(a donor's answer is untrusted input) with its one reason."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.paths import REPO_ROOT
from files import canary
from files.canary import Answer, BadAnswer, parse_answer

RECORDED = Path(__file__).parent / "canary_recorded"


def completion(tokens: list, logprobs: list, model: object = "uncloseai-testbed/tiny-qwen3",
               **extra: object) -> dict:
    """An OpenAI completions answer of vLLM's shape, with `logprobs: 1`."""
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
            "choices": [{"index": 0, "text": "".join(t for t in tokens if isinstance(t, str)),
                         "logprobs": {"tokens": tokens, "token_logprobs": logprobs,
                                      "text_offset": list(range(len(tokens))),
                                      "top_logprobs": [{} for _ in tokens]},
                         "finish_reason": "length", **extra}],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(tokens)}}


def raw(doc: object) -> bytes:
    return json.dumps(doc).encode()


# --- parse_answer: a well-formed answer, then one refusal per kind of hostile answer -----------

def test_a_well_formed_answer_is_read() -> None:
    got = parse_answer(raw(completion([" Paris", ".", ""], [-0.5, -1, -2.25])))
    assert got == Answer("uncloseai-testbed/tiny-qwen3", (" Paris", ".", ""), (-0.5, -1.0, -2.25))
    assert all(isinstance(v, float) for v in got.logprobs)


def test_refuses_an_oversized_answer() -> None:
    padded = completion(["a"], [-1.0], padding="x" * canary.ANSWER_LIMIT)
    with pytest.raises(BadAnswer, match=f"answer over {canary.ANSWER_LIMIT} bytes"):
        parse_answer(raw(padded))


def test_refuses_what_is_not_json() -> None:
    with pytest.raises(BadAnswer, match=r"not a completion with log-probabilities \(JSONDecode"):
        parse_answer(b"<html>502 Bad Gateway</html>")


@pytest.mark.parametrize("drop", ["model", "choices", "logprobs", "tokens", "token_logprobs"])
def test_refuses_an_answer_missing_a_field(drop: str) -> None:
    doc = completion(["a"], [-1.0])
    choice = doc["choices"][0]
    if drop in ("model", "choices"):
        del doc[drop]
    elif drop == "logprobs":
        choice["logprobs"] = None  # what vLLM sends when the request asked for none
    else:
        del choice["logprobs"][drop]
    with pytest.raises(BadAnswer, match="not a completion with log-probabilities"):
        parse_answer(raw(doc))


def test_refuses_an_answer_with_no_choice() -> None:
    doc = completion(["a"], [-1.0])
    doc["choices"] = []
    with pytest.raises(BadAnswer, match=r"not a completion with log-probabilities \(IndexError"):
        parse_answer(raw(doc))


def test_refuses_a_top_level_of_the_wrong_type() -> None:
    with pytest.raises(BadAnswer, match=r"not a completion with log-probabilities \(TypeError"):
        parse_answer(raw(["model", "choices"]))


@pytest.mark.parametrize("model", [None, 7, ["a"], "", "m" * 201])
def test_refuses_a_model_that_is_not_a_short_string(model: object) -> None:
    with pytest.raises(BadAnswer, match="its model is not a short string"):
        parse_answer(raw(completion(["a"], [-1.0], model=model)))


@pytest.mark.parametrize("tokens, logprobs", [
    ("abc", [-1.0, -1.0, -1.0]),          # a string, not a list of tokens
    (["a"], {"0": -1.0}),                  # log-probabilities not a list
    (["a", "b"], [-1.0]),                  # one short
    ([], []),                              # no token at all
], ids=["tokens-a-string", "logprobs-a-dict", "lengths-differ", "empty"])
def test_refuses_token_lists_of_the_wrong_shape(tokens: object, logprobs: object) -> None:
    with pytest.raises(BadAnswer, match=f"not 1 to {canary.MAX_TOKENS} tokens"):
        parse_answer(raw(completion(tokens, logprobs)))


def test_refuses_too_many_tokens() -> None:
    n = canary.MAX_TOKENS + 1
    with pytest.raises(BadAnswer, match=f"not 1 to {canary.MAX_TOKENS} tokens"):
        parse_answer(raw(completion(["a"] * n, [-1.0] * n)))
    assert len(parse_answer(raw(completion(["a"] * n, [-1.0] * n)), max_tokens=n).tokens) == n


@pytest.mark.parametrize("token", [5, None, ["a"], "t" * (canary.TOKEN_LIMIT + 1)],
                         ids=["int", "null", "list", "oversized"])
def test_refuses_a_token_that_is_not_a_short_string(token: object) -> None:
    with pytest.raises(BadAnswer, match="a token is not a short string"):
        parse_answer(raw(completion(["a", token], [-1.0, -1.0])))


@pytest.mark.parametrize("value", ["-1.0", None, [-1.0], {"v": -1}], ids=str)
def test_refuses_a_logprob_of_the_wrong_type(value: object) -> None:
    with pytest.raises(BadAnswer, match="a log-probability is not a number"):
        parse_answer(raw(completion(["a", "b"], [-1.0, value])))


@pytest.mark.parametrize("value", [True, False])
def test_refuses_a_bool_as_a_number(value: bool) -> None:
    with pytest.raises(BadAnswer, match="a log-probability is not a number"):
        parse_answer(raw(completion(["a"], [value])))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_refuses_nan_and_infinities(text: str) -> None:
    # Python's json writes and reads these bare words; a hostile server may send them.
    body = raw(completion(["a"], [-1.0])).replace(b"[-1.0]", f"[{text}]".encode())
    with pytest.raises(BadAnswer, match=r"a log-probability of .*\(a finite number <= 0 is one\)"):
        parse_answer(body)


@pytest.mark.parametrize("value", [0.5, 1, 1e300])
def test_refuses_a_positive_logprob(value: float) -> None:
    with pytest.raises(BadAnswer, match=re.escape(f"a log-probability of {value!r} (")):
        parse_answer(raw(completion(["a"], [value])))
    assert parse_answer(raw(completion(["a"], [0]))).logprobs == (0.0,)  # probability 1: fine


def test_refuses_a_huge_number() -> None:
    # 1e999 reads as inf in Python's json: refused as not finite, not as an overflow traceback.
    body = raw(completion(["a"], [-1.0])).replace(b"[-1.0]", b"[-1e999]")
    with pytest.raises(BadAnswer, match="a log-probability of -inf"):
        parse_answer(body)
    assert not math.isfinite(json.loads("-1e999"))


# --- score and verdict on hand-made answers ----------------------------------------------------

def answer(tokens: str, *logprobs: float) -> Answer:
    return Answer("m", tuple(tokens), tuple(logprobs))


def test_agreement_stops_at_the_first_different_token() -> None:
    ref = [answer("abcd", -1, -2, -3, -4), answer("xy", -1, -1)]
    got = [answer("abXd", -1.5, -2, -9, -4), answer("xy", -1, -1.25)]
    s = canary.score(ref, got)
    # a, b of the first (d after the difference does not count), x, y of the second
    assert (s.matched, s.total) == (4, 6) and s.agree == pytest.approx(4 / 6)
    assert s.gap == pytest.approx((0.5 + 0 + 0 + 0.25) / 4)


def test_a_shorter_answer_matches_only_what_it_has() -> None:
    s = canary.score([answer("abcd", -1, -1, -1, -1)], [answer("ab", -1, -1)])
    assert (s.matched, s.agree, s.gap) == (2, 0.5, 0.0)


def test_nothing_matched_has_an_infinite_gap() -> None:
    s = canary.score([answer("ab", -1, -1)], [answer("ba", -1, -1)])
    assert s.agree == 0 and s.gap == math.inf
    assert "0 of 2 reference tokens agreed" in canary.verdict(s, 0.5, 1.0)


def test_answers_for_other_prompts_are_refused() -> None:
    with pytest.raises(ValueError, match="1 answers for 2 reference prompts"):
        canary.score([answer("a", -1)] * 2, [answer("a", -1)])


def test_verdict_names_the_failing_measure() -> None:
    close = canary.Score(agree=1.0, gap=0.01, matched=8, total=8)
    far = canary.Score(agree=1.0, gap=0.4, matched=8, total=8)
    assert canary.verdict(close, 0.9, 0.05) is None
    assert canary.verdict(far, 0.9, 0.05) == "log-probabilities 0.400 apart on average (> 0.05)"


# --- the recordings: honest ones pass, wrong ones fail, with the recommended thresholds ----------

# Recommended by bench/canary_spread.py's runs of 2026-12-03 (docs/benchmarks.md says why): every
# honest case agreed on all 48 tokens, at most 0.0027 from the reference (another --dtype; 0 for
# restarts, load, another deploy, batch and prefix-cache settings); a wrong checkpoint of the same
# shape agrees on all 48 too (this random checkpoint's greedy answer is its prompt's last byte
# repeated, whatever its weights), so the gap tells them apart: 0.209 for another checkpoint.
# The thresholds the edges use (inventory/defaults.yml), not copies of them.
KNOBS = load_inventory(REPO_ROOT / "inventory/donors.yml")[1]["edge-1"].canary
MIN_AGREE, MAX_GAP = KNOBS.min_agree, KNOBS.max_logprob_gap
OTHER_STACK_GAP = KNOBS.max_logprob_gap_other_stack
# Revisions as close as 3% noise: measured, not caught (the canary's limit at this threshold).
BELOW_RESOLUTION = {"noise-0.1pct-1", "noise-1pct-1", "noise-3pct-1"}


def load(path: Path) -> tuple[str, list[Answer]]:
    doc = json.loads(path.read_text())
    answers = [parse_answer(raw(completion(a["tokens"], a["logprobs"], a["model"])))
               for a in doc["answers"]]  # a recording is read as the edge reads an answer
    return doc["kind"], answers


RECORDINGS = {p.stem: load(p) for p in sorted(RECORDED.glob("*.json"))}
REFERENCE = RECORDINGS["reference-1"][1]
HONEST = sorted(n for n, (kind, _) in RECORDINGS.items() if kind == "honest" and n != "reference-1")
WRONG = sorted(n for n, (kind, _) in RECORDINGS.items() if kind == "wrong"
               and n not in BELOW_RESOLUTION)


def test_the_recordings_cover_the_measured_cases() -> None:
    cases = {n.rsplit("-", 1)[0] for n in RECORDINGS}
    assert {"repeat", "concurrent-load", "restart", "fresh-deploy", "dtype-float32",
            "dtype-float16", "max-num-seqs-2", "prefix-caching-off", "kv-cache-fp8"} <= cases, \
        cases
    assert {"other-seed", "noise-3pct", "noise-10pct", "other-shape"} <= cases, cases
    assert BELOW_RESOLUTION <= set(RECORDINGS)
    assert all(len(a) == len(canary.PROMPTS) for _, a in RECORDINGS.values())
    assert {a.model for _, ans in RECORDINGS.values() for a in ans} == {
        "uncloseai-testbed/tiny-qwen3"}  # every wrong model answered under the right name


def test_the_reference_scores_perfectly_against_itself() -> None:
    assert canary.score(REFERENCE, REFERENCE) == canary.Score(1.0, 0.0, 48, 48)


@pytest.mark.parametrize("name", HONEST)
def test_an_honest_recording_passes(name: str) -> None:
    result = canary.score(REFERENCE, RECORDINGS[name][1])
    assert canary.verdict(result, MIN_AGREE, MAX_GAP) is None, result


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_models_recording_fails(name: str) -> None:
    result = canary.score(REFERENCE, RECORDINGS[name][1])
    assert canary.verdict(result, MIN_AGREE, MAX_GAP) is not None, result


@pytest.mark.parametrize("name", sorted(BELOW_RESOLUTION))
def test_a_revision_within_the_honest_noise_passes(name: str) -> None:
    """The canary's documented limit: weights 0.1%, 1% and 3% (of each tensor's RMS) apart
    answer 0.0019, 0.0054 and 0.0144 from the reference: under MAX_GAP, which leaves room for
    honest differences 7 times the largest measured here (another dtype, 0.0027)."""
    result = canary.score(REFERENCE, RECORDINGS[name][1])
    assert canary.verdict(result, MIN_AGREE, MAX_GAP) is None, result


def test_an_fp8_kv_cache_is_another_stack_with_its_own_reference() -> None:
    """An fp8 KV cache (a card profile's setting: the issue's 3090) answers 0.041 from the
    bfloat16-cache reference: more than MAX_GAP, so each card stack has its own reference
    (issue 35), against which it scores like any honest run."""
    kind, fp8 = RECORDINGS["kv-cache-fp8-1"]
    assert kind == "stack"
    result = canary.score(REFERENCE, fp8)
    assert result.agree == 1.0 and result.gap > MAX_GAP
    assert "apart on average" in canary.verdict(result, MIN_AGREE, MAX_GAP)


def test_against_another_stacks_reference_the_wider_bound_tells_checkpoints_apart() -> None:
    """A donor with only another stack's reference is held to max_logprob_gap_other_stack: the
    fp8-cache donor passes it against the bfloat16-cache reference, another checkpoint (another
    seed, another shape) does not."""
    _, fp8 = RECORDINGS["kv-cache-fp8-1"]
    assert canary.verdict(canary.score(REFERENCE, fp8), MIN_AGREE, OTHER_STACK_GAP) is None
    for name in ("other-seed-1", "other-shape-1"):
        result = canary.score(REFERENCE, RECORDINGS[name][1])
        assert canary.verdict(result, MIN_AGREE, OTHER_STACK_GAP) is not None, (name, result)

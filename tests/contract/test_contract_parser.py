"""The contract suite, pure half: every answer of every supported release (answers.py) through the client's parser
and error classification (results.py)."""

from __future__ import annotations

import orjson
import pytest

from tokenmill_runner.generate.results import AttemptFailed, Generation, classify_error, parse_generation

from .answers import CASES, LEGACY, PROMPT, VOCAB, Answer, case_id


def read(answer: Answer) -> Generation | AttemptFailed:
    if answer.status != 200:
        content = answer.body.encode() if isinstance(answer.body, str) else orjson.dumps(answer.body)
        return classify_error(answer.status, content, "s")
    return parse_generation(answer.body, "s", 1, vocab_size=VOCAB)


@pytest.mark.parametrize("case", CASES + LEGACY, ids=case_id)
def test_every_answer_is_read_as_the_release_means_it(case: tuple[str, Answer]) -> None:
    _, answer = case
    result = read(answer)
    if answer.expect == "generation":
        assert isinstance(result, Generation), result
        assert result.prompt_tokens == len(PROMPT) and result.latency_s == 2.5
        assert result.output_ids == answer.body["output_ids"] and len(result.output_ids) == result.completion_tokens
        for name, value in answer.fields.items():
            assert getattr(result, name) == value, name
    else:
        assert isinstance(result, AttemptFailed), result
        assert (result.fault.value, result.reason) == (answer.expect, answer.reason)
        assert result.message.startswith("s: ")


def test_every_supported_release_has_its_answers() -> None:
    from tokenmill_runner.facts.releases import SUPPORTED_RELEASES

    assert {version for version, _ in CASES} == set(SUPPORTED_RELEASES)
    assert all(sum(1 for v, _ in CASES if v == version) >= 14 for version in SUPPORTED_RELEASES)

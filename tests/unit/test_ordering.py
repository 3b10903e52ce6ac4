"""Longest-expected-first admission: the expectation from the row's earlier answer (else the prompt's length
class), and the bounded window that releases the longest expected request first, ties in source order."""

from __future__ import annotations

from tokenmill_runner.generate.ordering import (
    MAX_WINDOW,
    LongestFirst,
    earlier_answer_chars,
    expected_output_tokens,
    window_size,
)


def row(answer: str | None, *, reasoning: str = "", arguments: str = "") -> list[dict]:
    messages: list[dict] = [{"role": "user", "content": "Explain the proof."}]
    if answer is not None:
        message: dict = {"role": "assistant", "content": answer}
        if reasoning:
            message["reasoning_content"] = reasoning
        if arguments:
            message["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": arguments}}]
        messages.append(message)
    return messages


def test_the_earlier_answer_counts_its_text_reasoning_and_tool_arguments():
    assert earlier_answer_chars(row("abcd", reasoning="xy", arguments='{"a":1}')) == 4 + 2 + 7
    multi_part = [{"role": "assistant", "content": [{"type": "text", "text": "abc"}, {"type": "image_url"}]}]
    assert earlier_answer_chars(multi_part) == 3
    assert earlier_answer_chars(row(None)) == 0


def test_a_known_answer_outranks_any_prompt_class_and_longer_answers_rank_higher():
    long_answer, short_answer = expected_output_tokens(row("x" * 8000), 30), expected_output_tokens(row("x" * 40), 30)
    assert long_answer == 2000 and short_answer == 10
    # Without an answer the prompt's length class orders the rows, below any real answer of 4 tokens or more.
    classes = [expected_output_tokens(row(None), n) for n in (10, 300, 2000, 9000)]
    assert classes == [0, 1, 2, 3]
    assert max(classes) < expected_output_tokens(row("x" * 16), 10)


def test_the_window_releases_the_longest_expected_first_and_keeps_source_order_on_ties():
    window: LongestFirst[str] = LongestFirst(3)
    released = [window.push(name, expected) for name, expected in
                [("a", 5), ("b", 50), ("c", 5), ("d", 1), ("e", 70), ("f", 5)]]
    # Nothing leaves until the window is full; then the longest held leaves each time one arrives.
    assert released == [None, None, None, "b", "e", "a"]
    assert len(window) == 3
    assert list(window.drain()) == ["c", "f", "d"]  # c before f: same expectation, source order


def test_the_window_is_bounded_whatever_the_concurrency():
    assert window_size(1) == 16 and window_size(64) == 1024
    assert window_size(100_000) == MAX_WINDOW

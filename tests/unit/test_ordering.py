"""Longest-expected-first admission: the expectation from the row's earlier answer (else the dataset's typical
output), the whole job's passes planned from the counting pass's length codes, the probe that turns a weak key off,
and the bounded window that releases the longest expected request first, ties in source order."""

from __future__ import annotations

import math
import random

from tokenmill_runner.generate.ordering import (
    FLAT_PASSES,
    MAX_WINDOW,
    WEAK_KEY,
    Cell,
    KeyCheck,
    LongestFirst,
    ReadProgress,
    code_tokens,
    earlier_answer_chars,
    expected_output_tokens,
    expected_tokens,
    log_correlation,
    plan_passes,
    probe_size,
    window_size,
)
from tokenmill_runner.source.length_key import ANSWER_CODES, CODES, length_code


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


def test_one_scale_for_every_dataset_answers_capped_and_rows_without_one_at_their_datasets_typical_length():
    assert expected_tokens(row("x" * 8000), 30, 10240, 1536.0) == 2000
    assert expected_tokens(row("x" * 80_000), 30, 1024, 150.0) == 1024, "no answer is longer than its cap"
    # A reasoning set's rows without answers go before a function-calling set's short answers.
    assert expected_tokens(row(None), 30, 32768, 4915.2) > expected_tokens(row("x" * 400), 30, 1024, 150.0)
    longer_prompt = expected_tokens(row(None), 5000, 10240, 1536.0)
    assert 1536.0 < longer_prompt < expected_tokens(row("x" * 4 * 1800), 30, 10240, 1536.0)
    # The code of a line stands for the middle of its answers' range: the same scale.
    code = length_code(row("x" * 8000), 30)
    assert code_tokens(code, 10240, 1536.0) / 2000 < 1.5 and code_tokens(1, 10240, 1536.0) == 1536.0


def test_the_passes_cover_every_code_once_longest_first_doubling_in_size():
    window = 100
    cells = [Cell(0, code, 15, 2.0 ** (code / 4)) for code in range(ANSWER_CODES, CODES)]  # 660 slots
    cells += [Cell(1, 1, 300, 2.0 ** (20.5 / 4))]  # another dataset's prompt class, between codes 20 and 21
    passes = plan_passes(cells, window, max_passes=6)
    assert len(passes) == 6
    of = {(cell.dataset, cell.code): cell for cell in cells}

    def members(one: dict[int, frozenset[int]]) -> list[Cell]:
        return [of[(d, c)] for d, codes in one.items() for c in codes if (d, c) in of]

    for number, one in enumerate(passes[:-1]):
        held = sorted(members(one), key=lambda cell: cell.expected)
        # A pass closes at a window of slots (the first FLAT_PASSES), then 2, 4 ... windows: with its shortest cell
        # it has them, without it not yet.
        size = window << max(0, number - FLAT_PASSES + 1)
        assert sum(c.slots for c in held) >= size > sum(c.slots for c in held[1:])
        assert held[0].expected >= max(c.expected for later in passes[number + 1:] for c in members(later))
    assert passes[0] == {0: frozenset(range(CODES - 7, CODES))}  # the 7 longest codes: 105 slots
    assert any(1 in one.get(1, ()) for one in passes[:-1]), "the other dataset's rows where their length puts them"
    read: dict[int, list[int]] = {0: [], 1: []}
    for one in passes:
        for dataset, codes in one.items():
            read[dataset] += sorted(codes)
    assert sorted(read[0]) == sorted(read[1]) == list(range(256)), "each code once, any byte a codes file holds too"
    assert 0 in passes[-1][0] and 0 in passes[-1][1]  # code 0 (bad rows) in the last pass
    assert plan_passes(cells, 10_000) == [{0: frozenset(range(256)), 1: frozenset(range(256))}], "fits: one pass"


def test_the_probe_scales_with_the_job_and_a_small_job_has_none():
    assert probe_size(100) == 0 and probe_size(10_000) == 200 and probe_size(10**7) == 512 and probe_size(400) == 64


def test_a_key_that_predicts_the_lengths_is_kept_and_one_that_does_not_is_turned_off():
    rng = random.Random(5)

    def verdict(rho: float) -> bool | None:
        check = KeyCheck(size=200)
        for slot in range(200):
            check.sent(slot, math.exp(6 + 1.6 * rng.gauss(0, 1)))
            assert check.weak is None  # not closed
        check.closed = True
        for slot in range(200):
            assert check.weak is None, "undecided while probe slots are out"
            z1, z2 = (math.log(check.expected[slot]) - 6) / 1.6, rng.gauss(0, 1)
            check.back(slot, round(math.exp(6 + 1.6 * (rho * z1 + math.sqrt(1 - rho * rho) * z2))))
        return check.weak

    assert verdict(0.9) is False
    assert verdict(0.2) is True
    same = KeyCheck(size=2, closed=True)
    same.sent("a", 5.0)
    same.sent("b", 5.0)
    same.back("a", 10)
    same.back("b", None)  # a failed slot: no length to compare
    assert same.weak is True and same.rho == 0.0, "a key that is the same everywhere says nothing"
    assert WEAK_KEY > log_correlation([(1, 1), (2, 1), (3, 1)])


def test_reads_are_tracked_so_the_fallback_reads_each_line_once():
    progress = ReadProgress(probe_end=10)
    progress.begin(frozenset({15}))
    assert not progress.in_pass(9, 15) and progress.in_pass(11, 15) and not progress.in_pass(11, 3)
    progress.position = 50  # the pass looked at lines up to 50 when the key was found weak
    assert not progress.unread(40, 15) and progress.unread(51, 15) and progress.unread(40, 3)
    assert not progress.unread(5, 3), "the probe's lines were read"
    progress.end()
    assert not progress.unread(60, 15)


def test_a_window_turned_to_arrival_order_releases_what_it_holds_first_come_first_served():
    window: LongestFirst[str] = LongestFirst(3)
    for name, expected in [("a", 5), ("b", 50), ("c", 7)]:
        assert window.push(name, expected) is None
    window.in_arrival_order()
    assert window.push("d", 99) == "a"
    assert [window.pop() for _ in range(3)] == ["b", "c", "d"]

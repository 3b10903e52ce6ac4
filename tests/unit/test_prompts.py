import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill_runner.source.prompts import Prompt, RowError, belongs_to_worker, parse_line
from tokenmill_runner.source.reader import read_prompts
from tokenmill_runner.source.scan import scan_source


def line(obj) -> bytes:
    return orjson.dumps(obj)


GOOD = {"sample_id": 7, "messages": [{"role": "user", "content": "hi"}]}


def test_good_row_keeps_its_id_as_string():
    prompt = parse_line(3, line(GOOD))
    assert isinstance(prompt, Prompt) and prompt.sample_id == "7" and prompt.line == 3 and prompt.tools is None


@pytest.mark.parametrize(
    ("raw", "reason", "fragment"),
    [
        (b'{"sample_id": 1, "messages": [', "invalid_json", "line 5: not valid JSON"),
        (b"[1, 2]", "not_an_object", "expected a JSON object"),
        (line({"sample_id": "x"}), "missing_messages", "no 'messages'"),
        (line({"sample_id": "x", "messages": []}), "empty_messages", "non-empty list"),
        (line({"sample_id": "x", "messages": [{"role": "bot", "content": "a"}]}), "unknown_role",
         "messages[0].role is 'bot'"),
        (line({"sample_id": "x", "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
         "non_string_content", "messages[0].content[0].text must be a string"),
        (line({"sample_id": "x", "messages": [{"role": "user"}]}), "non_string_content", "content is missing"),
        (line({"sample_id": "x", "messages": [{"role": "user", "content": "a"}], "tools": {"a": 1}}),
         "invalid_tools", "'tools' must be a list"),
        (line({"sample_id": [1], "messages": [{"role": "user", "content": "a"}]}), "invalid_sample_id", "sample_id"),
    ],
)
def test_bad_rows_say_line_and_reason(raw, reason, fragment):
    error = parse_line(5, raw)
    assert isinstance(error, RowError)
    assert error.reason == reason and error.line == 5
    assert fragment in error.message


def test_assistant_with_tool_calls_may_have_null_content():
    row = {"sample_id": "t", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        {"role": "user", "content": "thanks"}]}
    assert isinstance(parse_line(1, line(row)), Prompt)


def test_missing_id_falls_back_to_line_number():
    prompt = parse_line(12, line({"messages": [{"role": "user", "content": "a"}]}))
    assert prompt.sample_id == "L12"


def test_jsonl_streams_with_blank_lines_and_limit(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [line({"sample_id": i, "messages": [{"role": "user", "content": str(i)}]}) for i in range(5)]
    path.write_bytes(rows[0] + b"\n\n" + b"\n".join(rows[1:]) + b"\n")
    items = list(read_prompts(str(path), "jsonl"))
    assert [p.line for p in items] == [1, 3, 4, 5, 6]
    assert [p.sample_id for p in read_prompts(str(path), "jsonl", limit=2)] == ["0", "1"]
    assert scan_source(str(path), "jsonl").rows == 5 and scan_source(str(path), "jsonl", limit=3).rows == 3


def test_parquet_rows_with_json_string_tools(tmp_path):
    path = tmp_path / "p.parquet"
    table = pa.table({
        "sample_id": ["a", "b"],
        "messages": [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]],
        "tools": ['[{"type": "function", "function": {"name": "f"}}]', None],
    })
    pq.write_table(table, path)
    items = list(read_prompts(str(path), "parquet"))
    assert [p.sample_id for p in items] == ["a", "b"]
    assert items[0].tools == [{"type": "function", "function": {"name": "f"}}] and items[1].tools is None
    assert scan_source(str(path), "parquet").rows == 2


def test_a_dictionary_page_costs_once_so_its_row_group_is_read_in_one_batch(tmp_path):
    """Batches are sized by data bytes: dictionary pages, read from their page headers, are left out, since each
    further batch of a chunk holds one more copy of its dictionary (store/parquet_rows.py)."""
    from tokenmill_runner.store.parquet_rows import BATCH_BYTES, batch_rows, bounded_rows, open_parquet

    big = "w" * (BATCH_BYTES // 4)
    table = pa.table({"sample_id": [f"s{i}" for i in range(40)], "text": [big if i % 2 else "x" for i in range(40)]})
    pq.write_table(table, tmp_path / "dictionary.parquet", use_dictionary=True)
    pq.write_table(table, tmp_path / "plain.parquet", use_dictionary=False)
    dictionary = open_parquet(str(tmp_path / "dictionary.parquet"))
    assert dictionary.dictionary_bytes[0] > BATCH_BYTES // 4  # the header's uncompressed size, the value within
    assert batch_rows(dictionary, 0) >= 40  # one batch
    with open(tmp_path / "plain.parquet", "rb") as handle:  # a spooled S3 object is read through its handle
        plain = open_parquet(handle)
        assert plain.dictionary_bytes == [0] and batch_rows(plain, 0) < 10  # 20 copies of the text: split
        assert [row["sample_id"] for row in bounded_rows(plain, None)] == [f"s{i}" for i in range(40)]


def test_workers_split_samples_without_overlap():
    prompts = [Prompt(i, f"id-{i}", [], None) for i in range(1, 400)]
    shares = [[p for p in prompts if belongs_to_worker(p, w, 3)] for w in range(3)]
    assert sum(len(s) for s in shares) == len(prompts)
    assert all(len(s) > 80 for s in shares)
    duplicate = Prompt(999, "id-5", [], None)
    assert [belongs_to_worker(duplicate, w, 3) for w in range(3)] == [belongs_to_worker(prompts[4], w, 3)
                                                                      for w in range(3)]


def test_rows_over_the_bound_are_refused_unread_and_line_numbers_do_not_depend_on_it(tmp_path):
    from tokenmill_runner.source.row_size import RowBound

    bound = RowBound(context_length=8)  # 128 bytes
    exact = b'{"sample_id": "e", "messages": [{"role": "user", "content": "' + b"a" * 63 + b'"}]}'
    assert len(exact) == 128
    rows = [b'{"sample_id": "a", "messages": [{"role": "user", "content": "hi"}]}', exact + b"\r",
            b'{"sample_id": "big", "messages": [{"role": "user", "content": "' + b"w" * 10_000 + b'"}]}',
            b'{"sample_id": "z", "messages": [{"role": "user", "content": "bye"}]}']
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    items = list(read_prompts(str(path), "jsonl", bound=bound))
    assert [(i.line, i.sample_id) for i in items] == [(1, "a"), (2, "e"), (3, None), (4, "z")]
    assert items[2].reason == "prompt_too_long" and "the row is 10068 bytes, over the 128 bytes" in items[2].message
    # Parquet rows are measured by their bytes in the Arrow buffers, before they become Python objects.
    pq.write_table(pa.table({"sample_id": ["s", "l"], "prompt": ["short", "p" * 200]}), tmp_path / "p.parquet")
    short, long = read_prompts(str(tmp_path / "p.parquet"), "parquet", bound=bound)
    assert isinstance(short, Prompt) and long.reason == "prompt_too_long"
    assert long.message.startswith("line 2: the row is 216 bytes, over the 128 bytes")  # 9 + 6 + 1 + 200

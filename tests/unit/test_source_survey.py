"""The plan's bounded look at a source (source/survey.py): rows counted where the bound allows, estimated from the
bytes a row takes past it (and saying which), a sample spread over the source, and every bound (bytes, rows,
seconds) holding."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill_runner.source.survey import SurveyBounds, survey_source


def prompt_row(index: int, words: int) -> str:
    return json.dumps({"id": f"r{index}", "messages": [{"role": "user", "content": f"row {index} " + "w " * words}]})


def write_jsonl(path: Path, rows: list[str]) -> Path:
    path.write_text("".join(row + "\n" for row in rows))
    return path


def test_a_source_within_the_bound_is_counted_exactly_and_sampled_whole(tmp_path: Path):
    source = write_jsonl(tmp_path / "p.jsonl", [prompt_row(i, 10) for i in range(80)] + [""])
    survey = survey_source(str(source), "jsonl")
    assert (survey.rows, survey.exact, survey.how) == (80, True, "counted: 80 rows")
    assert len(survey.sample) == 80 and survey.sample[0].messages[0]["content"].startswith("row 0 ")


def test_the_limit_is_counted_as_the_rows_the_dataset_yields(tmp_path: Path):
    source = write_jsonl(tmp_path / "p.jsonl", [prompt_row(i, 10) for i in range(80)])
    survey = survey_source(str(source), "jsonl", limit=30)
    assert (survey.rows, survey.exact) == (30, True)
    assert len(survey.sample) == 30


def test_past_the_byte_bound_rows_are_estimated_from_stretches_spread_over_the_source(tmp_path: Path):
    # 2,000 rows, the second half four times longer: the head alone would overcount the rows by about 2x.
    rows = [prompt_row(i, 20) for i in range(1000)] + [prompt_row(i, 80) for i in range(1000, 2000)]
    source = write_jsonl(tmp_path / "p.jsonl", rows)
    size = source.stat().st_size
    bounds = SurveyBounds(max_bytes=size // 10, sample_rows=100, windows=8)
    survey = survey_source(str(source), "jsonl", bounds=bounds)
    assert not survey.exact and survey.how.startswith("estimated: ~")
    assert "8 stretches" in survey.how
    assert 0.75 * 2000 <= survey.rows <= 1.25 * 2000
    lines = [int(p.messages[0]["content"].split()[1]) for p in survey.sample]
    assert min(lines) < 250 and max(lines) > 1750  # the head and the tail both sampled
    assert len(survey.sample) <= 100


def test_a_compressed_source_past_the_bound_is_estimated_from_its_compressed_bytes(tmp_path: Path):
    words = random.Random(0)
    rows = [json.dumps({"messages": [{"role": "user", "content": f"{words.getrandbits(600):x}"}]})
            for _ in range(20000)]
    source = tmp_path / "p.jsonl.gz"
    source.write_bytes(gzip.compress("".join(r + "\n" for r in rows).encode(), mtime=0))
    bounds = SurveyBounds(max_bytes=source.stat().st_size // 3, sample_rows=50)
    survey = survey_source(str(source), "jsonl", bounds=bounds)
    assert not survey.exact and "compressed bytes a row" in survey.how
    assert 0.8 * 20000 <= survey.rows <= 1.2 * 20000
    assert 0 < len(survey.sample) <= 50


def test_the_time_bound_stops_the_read_and_says_so(tmp_path: Path):
    rows = [prompt_row(i, 10) for i in range(5000)]
    source = write_jsonl(tmp_path / "p.jsonl", rows)
    ticks = iter(range(1_000_000))
    survey = survey_source(str(source), "jsonl", bounds=SurveyBounds(seconds=3), clock=lambda: float(next(ticks)))
    assert not survey.exact and "stopped at the 3 s bound" in survey.how
    assert survey.rows >= 512  # what was read before the clock ran out still counts


def test_rows_that_are_not_prompts_are_counted_but_not_sampled(tmp_path: Path):
    source = write_jsonl(tmp_path / "p.jsonl", [prompt_row(0, 5), "{not json", prompt_row(2, 5)])
    survey = survey_source(str(source), "jsonl")
    assert (survey.rows, survey.refused, len(survey.sample)) == (3, 1, 2)


def test_parquet_rows_come_from_the_footer_and_the_sample_from_the_first_rows(tmp_path: Path):
    table = pa.table({"id": [f"r{i}" for i in range(500)],
                      "messages": [[{"role": "user", "content": f"row {i}"}] for i in range(500)]})
    source = tmp_path / "p.parquet"
    pq.write_table(table, source, row_group_size=100)
    survey = survey_source(str(source), "parquet", bounds=SurveyBounds(sample_rows=40))
    assert (survey.rows, survey.exact) == (500, True) and "Parquet footers" in survey.how
    assert len(survey.sample) == 40
    assert survey_source(str(source), "parquet", limit=120).rows == 120

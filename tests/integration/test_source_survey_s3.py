"""The plan's look at a source on S3 (moto's server over HTTP): a large JSONL object is read in ranged stretches
spread over it, never through, and a Parquet object's rows come from its footer by ranged reads."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill_runner.source.survey import SurveyBounds, survey_source
from tokenmill_runner.store.storage import S3Storage


def test_a_large_jsonl_object_is_surveyed_in_stretches_and_a_parquet_one_by_its_footer(s3_endpoint: str,
                                                                                         s3_bucket: str) -> None:
    store = S3Storage(f"s3://{s3_bucket}/", endpoint=s3_endpoint)
    rows = [json.dumps({"messages": [{"role": "user", "content": f"row {i} " + "w " * (20 if i < 1000 else 80)}]})
            for i in range(2000)]
    body = "".join(r + "\n" for r in rows).encode()
    store.put("p.jsonl", body)
    bounds = SurveyBounds(max_bytes=len(body) // 10, sample_rows=64, windows=8)
    survey = survey_source(f"s3://{s3_bucket}/p.jsonl", "jsonl", s3_endpoint, bounds=bounds)
    assert not survey.exact and "8 stretches" in survey.how and 1500 <= survey.rows <= 2500
    lines = [int(p.messages[0]["content"].split()[1]) for p in survey.sample]
    assert max(lines) > 1750  # the tail came from a ranged read, not a read through

    table = pa.table({"messages": [[{"role": "user", "content": f"row {i}"}] for i in range(300)]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=50)
    store.put("p.parquet", buffer.getvalue())
    survey = survey_source(f"s3://{s3_bucket}/p.parquet", "parquet", s3_endpoint, bounds=SurveyBounds(sample_rows=10))
    assert (survey.rows, survey.exact, len(survey.sample)) == (300, True, 10)

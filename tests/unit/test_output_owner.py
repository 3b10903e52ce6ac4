"""The runner refuses to write into an output that holds another model's run (run.json records what it ran)."""

from __future__ import annotations

import orjson
import pytest

from tokenmill_runner.prepare import check_output_owner
from tokenmill_runner.spec.resource import SpecError, parse_document
from tokenmill_runner.store.storage import LocalStorage


def spec(model: str, tokenizer: str | None = None):
    document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "r"},
                "spec": {"model": {"path": model, **({"tokenizer": tokenizer} if tokenizer else {})},
                         "datasets": [{"name": "a", "source": "a.jsonl"}], "output": {"uri": "out/"}}}
    return parse_document(document).spec


def test_an_empty_output_and_the_same_model_are_accepted(tmp_path):
    storage = LocalStorage(tmp_path)
    check_output_owner(storage, spec("s3://models/kimi/"))
    storage.put("run.json", orjson.dumps({"spec": spec("s3://models/kimi/").model_dump(mode="json", by_alias=True)}))
    check_output_owner(storage, spec("s3://models/kimi/", tokenizer="s3://models/kimi/"))


@pytest.mark.parametrize(("model", "tokenizer", "field"), [("s3://models/other/", None, "model.path"),
                                                          ("s3://models/kimi/", "s3://tok/", "model.tokenizer")])
def test_another_model_or_tokenizer_is_refused_with_both_names(tmp_path, model, tokenizer, field):
    storage = LocalStorage(tmp_path)
    storage.put("run.json", orjson.dumps({"spec": spec("s3://models/kimi/").model_dump(mode="json", by_alias=True)}))
    with pytest.raises(SpecError) as error:
        check_output_owner(storage, spec(model, tokenizer))
    message = str(error.value)
    assert field in message and "s3://models/kimi/" in message and "run.json" in message

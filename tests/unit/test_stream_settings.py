"""`tokenmill run` streams with its own process settings (cli.stream_settings, measured in docs/scale.md), and gives
them back: a user's TOKENIZERS_PARALLELISM is theirs to keep."""

from __future__ import annotations

import gc
import os

import pytest

from tokenmill_runner.cli import COLLECTOR_THRESHOLD, stream_settings


def test_the_stream_encodes_on_the_asking_thread_and_collects_less_often_then_restores(monkeypatch) -> None:
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    before = gc.get_threshold()
    with stream_settings():
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
        assert gc.get_threshold()[0] == COLLECTOR_THRESHOLD and gc.get_freeze_count() > 0
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


@pytest.mark.parametrize("chosen", ["true", "false"])
def test_a_users_tokenizer_parallelism_is_kept(monkeypatch, chosen: str) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", chosen)
    with stream_settings():
        assert os.environ["TOKENIZERS_PARALLELISM"] == chosen
    assert os.environ["TOKENIZERS_PARALLELISM"] == chosen

"""A resume's skip over settled lines holds nothing per line (issue 44): the reader's thread counts each settled
line as it skips it, and the loop takes the totals. Before, every skipped line waited in a Python list until the
first unsettled line (~37 bytes a line: 486 MiB for a resume at 10M samples)."""

from __future__ import annotations

import tracemalloc
from collections import Counter
from types import SimpleNamespace

from tokenmill_runner.generate.pipeline import Runner, SettledTally
from tokenmill_runner.spec.config import RunnerConfig
from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.ledger import DatasetLedger, ShardContent, build_marker

LINES = 10_000
SAMPLES = 2


def _ledger() -> DatasetLedger:
    """Every slot of LINES lines settled: rows, but slot (7, 1) given up (retryable) and (9, 0) a bad row."""
    rows = [{"sample_id": f"s{line}", "line": line, "sample_index": index, "completion_tokens": 3}
            for line in range(1, LINES + 1) for index in range(SAMPLES) if (line, index) not in ((7, 1), (9, 0))]
    errors = [{"line": 7, "sample_index": 1, "sample_id": "s7", "reason": "retries_exhausted"},
              {"line": 9, "sample_index": 0, "sample_id": "s9", "reason": "invalid_row"}]
    ledger = DatasetLedger("d", LINES, SAMPLES)
    ledger.fold(build_marker("d", "w000-x-000001", 0, ShardContent(rows, errors), 1))
    return ledger


def test_skipping_settled_lines_holds_nothing_per_line_and_counts_them_all() -> None:
    spec = DatasetGenerationSpec.model_validate({"model": {"path": "m"}, "datasets": [
        {"name": "d", "source": "p.jsonl", "samples": SAMPLES}], "output": {"uri": "/tmp/o"}})
    config = RunnerConfig(spec=spec, servers=["http://127.0.0.1:9"], output_uri="/tmp/o")
    state = SimpleNamespace(owned=None, first={}, ledger=_ledger(), samples=SAMPLES, skipped=0,
                            given_up_before=Counter())
    runner = SimpleNamespace(config=config, _settled=SettledTally())
    wanted = Runner._wanted.__get__(runner)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert not any(wanted(state, False, line) for line in range(1, LINES + 1))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The old list held ~37 bytes a line (370 kB here); a tally holds a count and a reason or two.
    assert held < 64 * 1024, held
    Runner._count_settled_lines.__get__(runner)(state)
    assert state.skipped == LINES * SAMPLES
    assert state.given_up_before == {"retries_exhausted": 1}

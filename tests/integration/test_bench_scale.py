"""The scale benchmark runs here at its --quick size and reports every measurement it promises. Its timings are not
asserted (they belong to the benchmark's table, docs/scale.md); its correctness checks are: the split of samples
over 64 workers and 100 replicas, with 8 workers killed and restarted, leaves no gap and no overlap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MEASURED = ("operator_cold", "operator_1", "operator_10", "runner_resume", "report")


def test_the_quick_scale_benchmark_measures_everything_and_splits_without_gap_or_overlap(tmp_path):
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(REPO / "hack/bench/bench_scale.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    small, large = results["sizes"]
    for backend in ("local", "s3"):
        for size in (small, large):
            measured = results["backends"][backend][str(size)]
            for name in MEASURED:
                assert measured[name]["peak_rss_mib"] > 0, (backend, size, name)
            operator = measured["operator_1"]
            assert operator["completed"] == size, "the committed 99 % plus the steady pass's 1 %: every slot"
            assert [len(operator[k]) for k in ("first", "steady")] == [1, 1]
            assert operator["full_listing"], "the full listing before a run ends, in one pass or more"
            assert operator["sweep"], "the periodic full listing, in one pass or more"
            assert len(measured["operator_10"]["first"]) == 10
            resume = measured["runner_resume"]
            assert resume["first_unsettled_line"] is None and resume["skipped"] == size, "a resume skips every slot"
    s3_pass = results["backends"]["s3"][str(large)]["operator_1"]["steady"][0]["calls"]
    # One page of marker names, and the dataset's seals folder (store/seals.py: empty unless a run was taken over)
    assert s3_pass.get("ListObjectsV2") == 2, "a steady pass lists one page of marker names and the seals"
    sweep = results["backends"]["s3"][str(large)]["operator_1"]["sweep"]
    # The periodic full listing's passes: its steps (a page of names and the seals) take turns with the incremental
    # passes (a page after the horizon and the seals): no pass lists more than a steady one.
    assert [p["calls"].get("ListObjectsV2") for p in sweep] == [2] * len(sweep), sweep
    # The one before a run ends: a step every pass, a page of names each (plus the seals of the first step).
    ending = results["backends"]["s3"][str(large)]["operator_1"]["full_listing"]
    assert all(p["calls"].get("ListObjectsV2", 0) <= 2 for p in ending), ending
    split = results["split"]
    assert (split["workers"], split["replicas"], split["killed_and_restarted"]) == (64, 100, 8)
    assert split["gap"] == 0 and split["overlap"] == 0 and split["lines_in_another_workers_marker"] == 0
    assert split["rows"] + split["errors"] == split["prompts"]
    assert set(split["errors_by_reason"]) == {"duplicate_sample_id", "invalid_json"}
    assert "split:" in done.stdout and "[s3]" in done.stdout

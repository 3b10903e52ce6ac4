"""Objects a tenant writes where the shared operator reads them, on moto's S3 server over HTTP: each is refused by
its size before it is read whole (docs/security.md "Bounded reads"; store/bounded_get.py). On main a 300 MiB
config.json took the operator to 1,013 MiB."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tokenmill_runner.store.bounded_get import CONFIG_BYTES, MARKER_BYTES, ObjectTooLarge, get_bounded
from tokenmill_runner.store.manifest import MANIFEST_BYTES, ManifestError, read_manifest
from tokenmill_runner.store.storage import open_storage

BIG = 64 * 1024 * 1024  # over every cap but the checkpoint's


def test_objects_over_their_cap_are_refused_by_name_without_reading_them_whole(s3_endpoint, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    storage = open_storage(f"s3://{s3_bucket}/tenant/", s3_endpoint)
    storage.put("config.json", b" " * BIG)
    storage.put("run.json", b" " * BIG)
    storage.put("d/commits/big.json", b" " * BIG)
    with pytest.raises(ObjectTooLarge, match=rf"tenant/config.json is over the {CONFIG_BYTES} bytes"):
        get_bounded(storage, "config.json", CONFIG_BYTES)
    with pytest.raises(ManifestError, match=rf"run.json is over the {MANIFEST_BYTES} bytes"):
        read_manifest(storage)
    with pytest.raises(ObjectTooLarge, match=rf"over the {MARKER_BYTES} bytes"):
        get_bounded(storage, "d/commits/big.json", MARKER_BYTES)
    storage.put("small.json", b"{}")
    assert get_bounded(storage, "small.json", CONFIG_BYTES) == b"{}"


def test_planning_from_a_300_mib_config_json_stays_small(s3_endpoint, s3_bucket, tmp_path, monkeypatch):
    """make_plan, the function the operator calls, in a child process: its peak RSS (VmHWM, reset at its start by
    /proc/self/clear_refs so what the forking parent held does not count) with a 300 MiB config.json at the
    tenant's model path."""
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with open(tmp_path / "config.json", "wb") as handle:
        for _ in range(300):
            handle.write(b" " * (1024 * 1024))
    # Uploaded by a child too: a child's peak RSS (getrusage) counts what its parent held when it forked.
    subprocess.run([sys.executable, "-c", "from tokenmill_runner.store.storage import open_storage; "
                    f"open_storage('s3://{s3_bucket}/models/huge/', '{s3_endpoint}').put_file('config.json', "
                    f"__import__('pathlib').Path('{tmp_path / 'config.json'}'))"], check=True, timeout=300)
    child = textwrap.dedent(f"""
        import sys, yaml
        from pathlib import Path
        def hwm():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        open("/proc/self/clear_refs", "w").write("5")
        from tokenmill_operator.observe.model_files import make_plan
        from tokenmill_runner.spec.resource import DatasetGenerationSpec
        document = yaml.safe_load(Path("examples/b5-openthoughts.yaml").read_text())["spec"]
        document["model"] = {{**document["model"], "path": "s3://{s3_bucket}/models/huge/", "weightBytes": 10**9}}
        document["output"] = {{**document["output"], "endpoint": "{s3_endpoint}"}}
        try:
            make_plan(DatasetGenerationSpec.model_validate(document), {{"AWS_ACCESS_KEY_ID": "test",
                      "AWS_SECRET_ACCESS_KEY": "test"}})
        except Exception as error:
            print(type(error).__name__, error)
        print("peak_kb", hwm())
    """)
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    print(run.stdout, run.stderr[-2000:])
    peak_kb = int(run.stdout.rsplit("peak_kb", 1)[1])
    assert "config.json is over the 4194304 bytes" in run.stdout
    assert peak_kb < 400 * 1024, peak_kb  # main: 1,013 MiB; the chart recommends a 512Mi limit

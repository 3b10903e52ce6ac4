"""`make cluster-demo` (hack/cluster_demo.py) on the session's control plane: the chart installed, the b5 example
applied, and `kubectl get dsgen -w` showing it from Pending to Succeeded, with the operator, S3, the simulator and
the runner pods on this machine (docs/operator.md, "On a laptop")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill_runner.store.manifest import read_manifest
from tokenmill_runner.store.storage import open_storage

from .conftest import REPO

pytestmark = pytest.mark.e2e


def test_the_cluster_demo_goes_from_pending_to_succeeded(cluster, namespace, tmp_path) -> None:
    release = f"demo-{namespace[-8:]}"
    out = tmp_path / "out"
    try:
        done = subprocess.run([sys.executable, str(REPO / "hack" / "cluster_demo.py"), "--kubeconfig",
                               str(cluster.kubeconfig), "--namespace", namespace, "--release", release,
                               "--chart-namespace", namespace, "--copy-to", str(out)],
                              capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run([cluster.tools["HELM_BIN"], "uninstall", release, "-n", namespace, "--kubeconfig",
                        str(cluster.kubeconfig)], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    # The watch's rows, in order: a new resource, then the server, generation, and the end.
    phases = [line.split()[1] for line in done.stdout.splitlines()[1:] if len(line.split()) > 1]
    assert phases and "Succeeded" in phases, done.stdout
    seen = [phase for phase in ("StartingServer", "Generating", "Succeeded") if phase in phases]
    assert seen == ["StartingServer", "Generating", "Succeeded"], phases
    assert "Succeeded: 75/75 (100.0%)" in done.stderr
    assert read_manifest(open_storage(str(out))) is not None and (out / "report" / "report.json").exists()

"""`make cluster-demo`: examples/b5-openthoughts.yaml from `kubectl apply` to Succeeded on a laptop, watched with
`kubectl -n tokenmill get dsgen -w`.

The local control plane (hack/cluster, kwok's fake GPU nodes) schedules pods but runs no container, so what a GPU
cluster would run in them runs on this machine instead, the way the e2e tests do it (tests/e2e/operator_kit.py):

- the operator: `tokenmill-operator` on the host, watching the cluster through its kubeconfig (the chart installs
  the CRD, RBAC and a Deployment whose pod kwok only pretends to run);
- S3: moto's server on loopback, holding the model's config.json and tokenizer and the B5 prompts;
- SGLang: the simulator, with the server's API key from the Secret the operator made;
- the runner pods: the real `tokenmill run` with each held pod's arguments and environment, then the pod is let go.

Usage: hack/cluster_demo.py [--kubeconfig PATH] [--namespace NS] [--keep]. Without --kubeconfig it starts (or
reuses) the cluster "tokenmill" (hack/cluster/cluster.sh up). --keep leaves the operator, S3 and the simulator
running until Ctrl-C; otherwise they stop once the run succeeded, after its output is copied to out/cluster-demo/.
See docs/operator.md, "On a laptop".
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import S3_ENV, free_port  # noqa: E402
from tests.e2e.conftest import CLUSTER_SH, STATE_DIR, _make_cluster, tool_paths  # noqa: E402
from tests.e2e.operator_kit import (  # noqa: E402
    NAME,
    Operator,
    b5_resource,
    dsgen,
    play_runner_pods,
    seed_b5_world,
    simulator_for,
    wait_phase,
)

# One runner pod, not the example's four: on a laptop each is a process of its own, and one finishes 75 prompts sooner.
RUNNERS = 1


def say(message: str) -> None:
    print(f"cluster-demo: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", type=Path, help="a running cluster (default: start the cluster 'tokenmill')")
    parser.add_argument("--namespace", default="tokenmill")
    parser.add_argument("--keep", action="store_true", help="keep the operator, S3 and the simulator until Ctrl-C")
    parser.add_argument("--release", default="tokenmill", help="the chart's release name")
    parser.add_argument("--chart-namespace", default="tokenmill-system", help="where the chart is installed")
    parser.add_argument("--copy-to", type=Path, default=REPO / "out" / "cluster-demo",
                        help="where the run's output is copied at the end")
    args = parser.parse_args(argv)
    tools = tool_paths()
    kubeconfig = args.kubeconfig
    if kubeconfig is None:
        subprocess.run([str(CLUSTER_SH), "up"], check=True)
        kubeconfig = STATE_DIR / "kubeconfig"
    cluster = _make_cluster("tokenmill", kubeconfig, tools, started_here=False)
    namespace = args.namespace
    say("installing the chart (CRD, RBAC, the operator's Deployment: kwok pretends to run its pod)")
    subprocess.run([tools["HELM_BIN"], "upgrade", "--install", args.release, str(REPO / "charts" / "tokenmill"),
                    "-n", args.chart_namespace, "--create-namespace", "--kubeconfig", str(kubeconfig)], check=True,
                   stdout=subprocess.DEVNULL)
    cluster.wait_established("datasetgenerations.tokenmill.io")
    cluster.kubectl("create", "namespace", namespace, check=False)

    from tests import s3_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    os.environ.update(S3_ENV)
    port = free_port()
    s3 = s3_server.start(port)
    endpoint = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="tokenmill-cluster-demo-"))
    operator = Operator(cluster, namespace, work / "operator.log")
    watch = None
    try:
        seed_b5_world(endpoint)
        say(f"S3 (moto) at {endpoint}: the model's config.json and tokenizer, and the B5 prompts")
        cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds", "namespace": namespace},
                       "stringData": {key: S3_ENV[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}})
        operator.start()
        say(f"the operator runs on this machine (log: {operator.log})")
        # An earlier demo's resource goes first; the operator removes its finalizer, so it runs by now.
        cluster.kubectl("-n", namespace, "delete", "dsgen", NAME, "--ignore-not-found", "--wait=true", timeout=180)
        resource = b5_resource(namespace, endpoint, **{"runner.parallelism": RUNNERS})
        resource["spec"]["output"]["uri"] = "s3://tokenmill-data/runs/b5-openthoughts/"
        cluster.apply(resource)
        say(f"applied examples/b5-openthoughts.yaml (S3 at {endpoint}); in another terminal:\n"
            f"  export KUBECONFIG={kubeconfig} PATH={Path(tools['KUBECTL_BIN']).parent}:$PATH\n"
            f"  kubectl -n {namespace} get dsgen -w")
        watch = subprocess.Popen([tools["KUBECTL_BIN"], "--kubeconfig", str(kubeconfig), "-n", namespace, "get",
                                  "dsgen", "-w"])
        cluster.wait_for(lambda: cluster.core.read_namespaced_secret(f"{NAME}-server-key", namespace),
                         "the server's API key (the operator plans, then creates the server)", timeout=180)
        with simulator_for(cluster, namespace) as simulator:
            say(f"the simulator stands in for SGLang at {simulator.url}; the runner pods run here as they start")
            play_runner_pods(cluster, namespace, simulator.url, work / "runners", count=RUNNERS)
            done = wait_phase(cluster, namespace, "Succeeded", timeout=300)
        time.sleep(1)  # the watch prints the last row
        report = done["status"].get("report") or {}
        say(f"Succeeded: {done['status']['progress']['display']}, report verdict {report.get('verdict')}")
        copy_output(endpoint, args.copy_to)
        say(f"kubectl -n {namespace} describe dsgen {NAME}   # conditions and events; make cluster-down removes "
            "the cluster")
        if args.keep:
            say("keeping the operator and S3 until Ctrl-C")
            while True:
                time.sleep(3600)
        shutil.rmtree(work, ignore_errors=True)  # the runner pods' logs; kept when the demo fails
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception:
        say(f"failed (logs in {work}); the operator's log ends:\n{operator.tail(3000)}")
        try:
            say(f"status: {dsgen(cluster, namespace).get('status')}")
        except Exception as error:  # noqa: BLE001 - the first failure is the one to see
            say(f"no status: {error}")
        raise
    finally:
        if watch is not None:
            watch.terminate()
        operator.stop()
        s3.stop()


def copy_output(endpoint: str, folder: Path) -> None:
    """The run's output from the demo's S3 server to `folder` (the server stops with the demo)."""
    from tokenmill_runner.store.storage import open_storage

    source = open_storage("s3://tokenmill-data/runs/b5-openthoughts/", endpoint)
    target = open_storage(str(folder))
    for key in source.list(""):
        target.put(key, source.get(key))
    say(f"the run's output is in {target.root_uri}: tokenmill report {target.root_uri} (report/report.md)")


if __name__ == "__main__":
    sys.exit(main())

"""`tokenmill-operator`: run the kopf operator (all namespaces, or those in TOKENMILL_NAMESPACES)."""

from __future__ import annotations

import logging
import os
import sys


def main() -> int:
    namespaces = [n for n in os.environ.get("TOKENMILL_NAMESPACES", "").split(",") if n]
    args = ["run", "--standalone", "-m", "tokenmill_operator.handlers",
            f"--liveness=http://{os.environ.get('TOKENMILL_HEALTH_ADDRESS', '0.0.0.0')}:"
            f"{os.environ.get('TOKENMILL_HEALTH_PORT', '8080')}/healthz"]
    args += [f"--namespace={n}" for n in namespaces] or ["--all-namespaces"]
    sys.argv = ["kopf", *args, *sys.argv[1:]]
    from .log_safety import protect

    protect()  # the library loggers, before kopf imports anything that logs (handlers.configure adds the filter)
    from kopf.cli import main as kopf_main

    try:
        kopf_main()  # click: ends with SystemExit
        code = 0
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else int(ended.code is not None)
    # kopf has stopped; a pass still in a worker thread (a read waiting on a slow or hung store) would hold the exit
    # until it ends, because Python joins those threads: 20 s and more after SIGTERM, a rollout's grace period. The
    # operator is built to be killed anywhere (every write is conditional or idempotent, faults.py's crash points
    # test it), so it leaves them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())

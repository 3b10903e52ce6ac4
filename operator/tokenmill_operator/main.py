"""`tokenmill-operator`: run the kopf operator (all namespaces, or those in TOKENMILL_NAMESPACES)."""

from __future__ import annotations

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

    return kopf_main()


if __name__ == "__main__":
    raise SystemExit(main())

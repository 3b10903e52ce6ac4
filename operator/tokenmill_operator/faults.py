"""Deterministic crash points for the fault tests: `TOKENMILL_OPERATOR_CRASH_AT=<point>` makes the operator SIGKILL
itself when a reconcile pass reaches that point, so a test can restart it there and check that nothing is lost,
duplicated or left behind. Unset (always, outside tests) it does nothing."""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

ENV = "TOKENMILL_OPERATOR_CRASH_AT"
# After the plan is made and before anything is applied; after the server StatefulSet is applied; after the runner
# Job is created; after the report files are written; after the Job is suspended and the server scaled to zero;
# after a Job is deleted to be replaced. Each is before the pass writes its status.
POINTS = ("planned", "server-applied", "job-created", "report-written", "suspended", "job-replaced")


def crash_point(point: str) -> None:
    if os.environ.get(ENV) == point:
        logger.warning("%s=%s: killing the operator here", ENV, point)
        os.kill(os.getpid(), signal.SIGKILL)

"""Runs a command and prints `{"code", "peak_kb", "killed"}` as JSON: the command's own peak RSS.

A thin process between the test and the command, because Linux keeps a process's peak across exec
(`signal->maxrss` takes the old mm's high-water mark): a command started by pytest itself, by fork or vfork, reports
pytest's RSS at the moment it started (830 MB late in a full run) as its own. Forked from this small interpreter
instead, the command's peak is its own plus a few MB. The command is killed once its RSS passes the limit, so an
unbounded reader fails its test instead of exhausting the machine.

    python peak_rss.py LIMIT_KB COMMAND...

With PEAK_RSS_STDERR=FILE in the environment the command's stderr goes to FILE (its error message, for the test).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):  # exited: a zombie has no VmRSS
        return None


def main(limit_kb: int, command: list[str]) -> None:
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 1)
        stderr = os.environ.get("PEAK_RSS_STDERR")
        os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if stderr else devnull, 2)
        os.execvp(command[0], command)
    killed = False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        rss = rss_kb(pid)
        if rss is not None and rss > limit_kb and not killed:
            killed = True
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status), "peak_kb": usage.ru_maxrss, "killed": killed}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])

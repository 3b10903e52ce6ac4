"""The S3 server the tests, the cluster demo and the benchmarks run: moto's (a real S3 implementation over HTTP on
loopback that honours conditional writes), in a thread of this process (`start`) or in a process of its own
(`spawn`, which runs `python -m tests.s3_server --port N`).

One change to how moto serves, none to what it answers: its host dispatcher calls
`moto.backends.list_of_moto_modules()` twice for every request (moto 5.2.6 `moto_server/werkzeug_app.py:127`), and
that lists moto's package folder and stats each of its ~170 entries (`moto/backends.py:189-195`). Profiled serving
400 small GETs, that was ~40 % of moto's CPU a request (3.3-4.6 ms a GET before, 2.2-2.9 after), spent on the two
cores the code under test runs on. The folder does not change while a server runs, so it is listed once.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from moto import backends
from moto.server import ThreadedMotoServer

REPO = Path(__file__).resolve().parents[1]
_list_of_moto_modules = backends.list_of_moto_modules


@cache
def _moto_modules() -> tuple[str, ...]:
    return tuple(_list_of_moto_modules())


def _listed_once() -> Iterator[str]:
    return iter(_moto_modules())


def start(port: int) -> ThreadedMotoServer:
    """moto's server on 127.0.0.1:`port`, serving from a thread of this process (stop it with `.stop()`)."""
    backends.list_of_moto_modules = _listed_once
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def spawn(port: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """moto's server on 127.0.0.1:`port` in a process of its own (moto serves one request at a time under its GIL:
    a server of its own keeps it off the caller's), quiet; the caller waits until it answers."""
    return subprocess.Popen([sys.executable, "-m", "tests.s3_server", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description="moto's S3 server on 127.0.0.1, until killed")
    parser.add_argument("--port", type=int, required=True)
    start(parser.parse_args().port)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()

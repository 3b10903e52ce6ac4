"""The simulator as its own process (`tokenmill sim-server`), killed with SIGKILL like a crashed SGLang server, and
restarted on the same port; and a runner driven to a point of its progress before a fault is injected."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import free_port
from tokenmill_runner.generate.pipeline import Runner
from tokenmill_runner.generate.summary import RunSummary


class SimProcess:
    """One `tokenmill sim-server` process on a fixed port."""

    def __init__(self, model: Path, port: int | None = None, **flags: Any) -> None:
        self.model = model
        self.port = port or free_port()
        self.flags = flags
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True, **flags: Any) -> SimProcess:
        args = [sys.executable, "-m", "tokenmill_runner.cli", "-q", "sim-server", "--model-path", str(self.model),
                "--port", str(self.port)]
        for name, value in {**self.flags, **flags}.items():
            flag = f"--{name.replace('_', '-')}"
            args += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if wait:
            self.wait_listening()
        return self

    def wait_listening(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self._stderr()
            try:
                httpx.get(f"{self.url}/health", timeout=1.0)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError(f"the simulator on port {self.port} did not start: {self._stderr()}")

    def kill(self) -> None:
        """SIGKILL: in-flight connections are reset by the kernel, the port refuses from now on."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def _stderr(self) -> str:
        if self.process is None or self.process.poll() is None or self.process.stderr is None:
            return ""
        return self.process.stderr.read().decode(errors="replace")[-2000:]

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()


async def run_with_faults(runner: Runner, faults: list[tuple[int, Callable[[], Awaitable[None] | None]]],
                          poll_s: float = 0.02) -> RunSummary:
    """Run, and inject each fault once `done` samples (generated, failed or skipped) are reached."""
    task = asyncio.create_task(runner.run())
    for threshold, fault in faults:
        while runner.snapshot().done < threshold:
            assert not task.done(), f"the run ended before {threshold} samples were done: {task.result()}"
            await asyncio.sleep(poll_s)
        result = fault()
        if result is not None:
            await result
    return await task

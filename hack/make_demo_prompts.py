#!/usr/bin/env python3
"""Generate examples/prompts/swe.jsonl: long, SWE-agent-like prompts for the demo's B8_sweagent dataset.

Each row is a system message (an agent scaffold with tool instructions) and a user message (an issue plus code
context: repository layout, source files, a stack trace or failing test output, recent commits). The building
blocks below are hand-written for tokenmill -- fictional projects in Python, Go, TypeScript/JavaScript and Rust,
each with its own bug -- and every scenario is rendered three ways (different agent scaffold, framing and
context), so no two rows share the same prompt. The output is deterministic:

    .venv/bin/python hack/make_demo_prompts.py [--out examples/prompts/swe.jsonl]

The function-calling and reasoning prompt files are hand-written JSONL and are not produced by this script.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "examples" / "prompts" / "swe.jsonl"


def dedent(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


TOOLCHAINS = {
    "Python": ("Python 3.11 with pip and pytest", "python"),
    "Go": ("Go 1.22, with the module cache pre-populated", "go"),
    "TypeScript": ("Node.js 20 and npm; dependencies are installed", "typescript"),
    "JavaScript": ("Node.js 20 and npm; dependencies are installed", "javascript"),
    "Rust": ("stable Rust 1.79 with cargo; the registry cache is warm", "rust"),
}

# ----------------------------------------------------------------------------------------------------------------
# Agent scaffolds (system messages)
# ----------------------------------------------------------------------------------------------------------------

SYSTEM_ACI = dedent("""
    You are an autonomous software engineer working inside a terminal session. The repository {repo} is checked
    out at {workdir}. Nobody will answer questions during the task: the only thing the maintainers will see is
    the patch you submit at the end.

    The terminal is an ordinary bash shell, plus a file viewer/editor that shows {window} lines of one file at a
    time. Besides standard shell commands you can use these:

    open <path> [<line>]
        Opens <path> in the viewer, optionally positioned so that <line> is visible.
    goto <line>
        Moves the viewer window of the open file to <line>.
    scroll_down
    scroll_up
        Moves the viewer window by {window} lines.
    find_file <name> [<dir>]
        Lists files named <name> (shell wildcards allowed) below <dir>, the current directory by default.
    search_dir <text> [<dir>]
        Lists the files below <dir> that contain <text>, with the number of matches in each.
    search_file <text> [<path>]
        Prints the lines of <path> (default: the open file) that contain <text>, with their line numbers.
    edit <start>:<end>
    <replacement text>
    end_of_edit
        Replaces lines <start> to <end> (inclusive) of the open file with the replacement text. Indentation is
        taken literally: type it exactly as it must appear in the file. After each edit the changed region is
        shown again; if a syntax check fails the edit is rolled back and you must issue a corrected one.
    create <path>
        Creates an empty file and opens it.
    submit
        Ends the session and submits the current diff of the repository.

    Rules:
    1. Send exactly ONE command per response and wait for its output. If you send more, only the first runs.
    2. Interactive programs are not available (no REPLs, editors, pagers, or `git log` without `--no-pager`).
       Put experiments in a script and run it, for example `{run_example}`.
    3. Each response has two parts: a short DISCUSSION paragraph explaining what you are about to do and why,
       then the command in a single fenced code block.
    4. Reproduce the bug before you change anything. After the fix, rerun the reproduction and the relevant
       tests with `{test_cmd}`.
    5. Keep the patch small and consistent with the surrounding code: no drive-by reformatting, no new
       dependencies, and delete your scratch files before you submit.
    6. When a command fails, read the error before you try again; never repeat a failing command unchanged.
""")

SYSTEM_TOOLS = dedent("""
    You are DevPilot, an AI engineer that resolves issues in software repositories. You work in a sandboxed
    Linux container in which the repository {repo} is checked out at {workdir}. Toolchain: {toolchain}.

    You act only through tool calls. Available tools:

    * execute_bash(command: string, timeout: integer = 120)
      Runs a command in a persistent bash shell and returns stdout, stderr and the exit code. Start servers
      and other long-running processes in the background with their output redirected to a file. A command
      that exceeds the timeout is interrupted and its partial output returned.
    * view(path: string, view_range: [integer, integer] | null)
      Shows a file with line numbers (optionally only the given range), or lists a directory two levels deep.
    * str_replace(path: string, old_str: string, new_str: string)
      Replaces exactly one occurrence of old_str in the file. old_str must match byte for byte, whitespace
      included, and must be unique in the file: include enough surrounding lines to make it so.
    * insert(path: string, insert_line: integer, new_str: string)
      Inserts new_str after line insert_line (0 inserts at the top).
    * create(path: string, file_text: string)
      Writes a new file; fails if the path already exists.
    * think(thought: string)
      Records a thought and has no other effect. Use it to weigh hypotheses when a bug has several causes.
    * finish(summary: string)
      Ends the task. Call it only when the change is complete and the tests pass.

    Guidelines:
    - Explore before you edit: read the files the issue mentions and the code that calls them.
    - Write a minimal reproduction and confirm it fails for the reason the issue describes.
    - Fix the root cause rather than the symptom, and think about edge cases: empty input, boundaries,
      concurrency, encodings, time zones, very large values.
    - Run the test suite with `{test_cmd}`, and add a regression test for the bug you fixed.
    - Never weaken or delete existing tests to make them pass, and do not commit: the harness collects the
      diff of the working tree.
    - The container has no network access apart from package mirrors that are already configured.
    - Keep your messages short; the detail belongs in the tool calls.
""")

SYSTEM_PAIR = dedent("""
    You are a senior {lang} engineer pairing with a maintainer of {repo}. You have shell access to a clean
    checkout at {workdir} ({toolchain}). The maintainer is busy: they want a correct patch that is easy to
    review, not a rewrite.

    Work through these steps in order, and say which step you are on:
      1. Restate the bug in one or two sentences and name the function(s) you believe are responsible.
      2. Reproduce it with the smallest possible script or test.
      3. Explain the root cause, quoting the offending lines.
      4. Fix it. Prefer the smallest diff that is obviously correct, and keep public APIs stable unless the
         issue asks for a change.
      5. Add a regression test next to the existing tests and run `{test_cmd}`.
      6. Write a commit message: a subject line under 72 characters, a blank line, then a short body that
         explains why the change is needed.

    To run a command, reply with a single fenced block whose info string is `shell`; its output comes back in
    the next message. To change files, reply with a unified diff (paths relative to the repository root) in a
    fenced block whose info string is `diff`; it is applied with `git apply --3way`. One action per reply.

    If the intended behaviour is unclear, say so, and choose the interpretation that matches the documentation
    and the existing tests. Do not guess at APIs you have not read: open the file first.
""")

SYSTEMS = [SYSTEM_ACI, SYSTEM_TOOLS, SYSTEM_PAIR]

# ----------------------------------------------------------------------------------------------------------------
# Scenarios. Each is a fictional project with one bug; the code is written for these prompts.
# ----------------------------------------------------------------------------------------------------------------

SCENARIOS: list[dict] = []


def scenario(**fields) -> None:
    SCENARIOS.append(fields)


# ------------------------------------------------------------------------------------------------ Python: paging
scenario(
    repo="ledgerline/ledgerline-python",
    lang="Python",
    test_cmd="python -m pytest -q tests/",
    title="list_invoices() silently drops the last partial page",
    issue=dedent("""
        **Describe the bug**
        `LedgerlineClient.list_invoices()` does not return every invoice when the total is not a multiple of the
        page size. We have 1,237 open invoices in our sandbox account; `len(client.list_invoices(status="open"))`
        returns 1,200. The dashboard and a raw `curl` against `/v2/invoices?status=open` both report
        `"total": 1237`.

        **To reproduce**
        ```python
        from ledgerline import LedgerlineClient
        client = LedgerlineClient(api_key=os.environ["LEDGERLINE_KEY"], base_url="https://sandbox.ledgerline.io")
        invoices = client.list_invoices(status="open")
        print(len(invoices))           # 1200, expected 1237
        print(invoices[-1]["number"])  # INV-2024-1200
        ```
        With `page_size=100` we get 1,200 as well, and with `page_size=1000` we get 1,000. When there are fewer
        invoices than one page (e.g. a fresh account with 7 invoices) everything is returned.

        **Expected behavior**
        All 1,237 invoices are returned, in the same order as the API returns them.

        **Environment**
        ledgerline 2.4.1, Python 3.11.6, requests 2.31.0, Ubuntu 22.04.

        **Additional context**
        This broke our month-end reconciliation job without any error: we only noticed because the sum of
        amounts did not match the bank statement. I think it started after the switch to the new paginator
        in 2.4.0 ("reduce number of round trips"), but I have not bisected it.
    """),
    tree=dedent("""
        ledgerline-python/
        ├── CHANGELOG.md
        ├── pyproject.toml
        ├── src/ledgerline/
        │   ├── __init__.py
        │   ├── client.py
        │   ├── errors.py
        │   ├── models.py
        │   ├── pagination.py
        │   └── retry.py
        └── tests/
            ├── conftest.py
            ├── test_client.py
            ├── test_pagination.py
            └── test_retry.py
    """),
    files=[
        ("src/ledgerline/pagination.py", dedent('''
            """Helpers that turn Ledgerline's offset-based list endpoints into Python iterators."""

            from __future__ import annotations

            from typing import Any, Callable, Iterator

            Page = dict[str, Any]
            FetchPage = Callable[[int, int], Page]


            class OffsetPaginator:
                """Iterate over every item of a list endpoint.

                The first request tells us the total number of items, so the remaining pages can be requested
                without waiting for ``has_more`` on each response (see ``prefetch`` in the client).
                """

                def __init__(self, fetch: FetchPage, page_size: int = 100, limit: int | None = None) -> None:
                    if page_size <= 0:
                        raise ValueError("page_size must be positive")
                    self._fetch = fetch
                    self.page_size = page_size
                    self.limit = limit

                def page_offsets(self, total: int) -> list[int]:
                    """Offsets of the pages after the first one."""
                    num_pages = max(1, total // self.page_size)
                    return [index * self.page_size for index in range(1, num_pages)]

                def __iter__(self) -> Iterator[dict[str, Any]]:
                    first = self._fetch(0, self.page_size)
                    yielded = 0
                    for item in first["data"]:
                        if self.limit is not None and yielded >= self.limit:
                            return
                        yield item
                        yielded += 1
                    for offset in self.page_offsets(int(first["total"])):
                        page = self._fetch(offset, self.page_size)
                        for item in page["data"]:
                            if self.limit is not None and yielded >= self.limit:
                                return
                            yield item
                            yielded += 1
        ''')),
        ("src/ledgerline/client.py", dedent('''
            from __future__ import annotations

            import logging
            from typing import Any, Iterator

            import requests

            from .errors import LedgerlineError, raise_for_response
            from .pagination import OffsetPaginator
            from .retry import RetryPolicy

            log = logging.getLogger(__name__)

            DEFAULT_BASE_URL = "https://api.ledgerline.io"


            class LedgerlineClient:
                def __init__(
                    self,
                    api_key: str,
                    base_url: str = DEFAULT_BASE_URL,
                    timeout: float = 10.0,
                    retry: RetryPolicy | None = None,
                    session: requests.Session | None = None,
                ) -> None:
                    if not api_key:
                        raise LedgerlineError("an API key is required")
                    self._base_url = base_url.rstrip("/")
                    self._timeout = timeout
                    self._retry = retry or RetryPolicy()
                    self._session = session or requests.Session()
                    self._session.headers.update({"Authorization": f"Bearer {api_key}", "Accept": "application/json"})

                def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
                    url = f"{self._base_url}{path}"
                    for attempt in self._retry.attempts():
                        response = self._session.request(method, url, timeout=self._timeout, **kwargs)
                        if response.status_code in (429, 502, 503) and attempt.can_retry:
                            log.debug("retrying %s %s after HTTP %s", method, path, response.status_code)
                            attempt.wait(response.headers.get("Retry-After"))
                            continue
                        raise_for_response(response)
                        return response.json()
                    raise LedgerlineError(f"{method} {path}: retries exhausted")

                def get_invoice(self, invoice_id: str) -> dict[str, Any]:
                    return self._request("GET", f"/v2/invoices/{invoice_id}")

                def iter_invoices(
                    self, status: str | None = None, limit: int | None = None, page_size: int = 100
                ) -> Iterator[dict[str, Any]]:
                    params: dict[str, Any] = {}
                    if status is not None:
                        params["status"] = status

                    def fetch(offset: int, size: int) -> dict[str, Any]:
                        return self._request("GET", "/v2/invoices", params={**params, "offset": offset, "limit": size})

                    return iter(OffsetPaginator(fetch, page_size=page_size, limit=limit))

                def list_invoices(
                    self, status: str | None = None, limit: int | None = None, page_size: int = 100
                ) -> list[dict[str, Any]]:
                    return list(self.iter_invoices(status=status, limit=limit, page_size=page_size))
        ''')),
        ("CHANGELOG.md", dedent('''
            ## 2.4.1
            - Fix `Retry-After` header parsing when the value is an HTTP date.

            ## 2.4.0
            - Pagination: compute the page offsets from the `total` of the first response instead of following
              `has_more`, to reduce the number of round trips and allow prefetching.
            - `list_invoices()` and `iter_invoices()` accept `page_size`.
            - Drop support for Python 3.8.
        ''')),
    ],
    trace=dedent("""
        $ python reproduce.py
        requested total (from first page): 1237
        GET /v2/invoices?status=open&offset=0&limit=100
        GET /v2/invoices?status=open&offset=100&limit=100
        ...
        GET /v2/invoices?status=open&offset=1100&limit=100
        received 1200 invoices, last number INV-2024-1200
        missing: INV-2024-1201 .. INV-2024-1237 (37 invoices)
    """),
    test=("tests/test_pagination.py", dedent('''
        import pytest

        from ledgerline.pagination import OffsetPaginator


        def fake_api(total):
            items = [{"number": f"INV-{i:04d}"} for i in range(1, total + 1)]
            calls = []

            def fetch(offset, size):
                calls.append((offset, size))
                return {"data": items[offset:offset + size], "total": total, "has_more": offset + size < total}

            return fetch, calls


        @pytest.mark.parametrize("total,page_size", [(0, 10), (7, 10), (10, 10), (25, 10), (1237, 100)])
        def test_returns_every_item(total, page_size):
            fetch, _ = fake_api(total)
            numbers = [item["number"] for item in OffsetPaginator(fetch, page_size=page_size)]
            assert numbers == [f"INV-{i:04d}" for i in range(1, total + 1)]


        def test_limit_stops_early():
            fetch, calls = fake_api(95)
            items = list(OffsetPaginator(fetch, page_size=10, limit=12))
            assert len(items) == 12
            assert calls == [(0, 10), (10, 10)]
    ''')),
    test_output=dedent("""
        $ python -m pytest -q tests/test_pagination.py
        ..F.F.                                                                   [100%]
        =================================== FAILURES ===================================
        _____________________ test_returns_every_item[25-10] _____________________
        total = 25, page_size = 10

            @pytest.mark.parametrize("total,page_size", [(0, 10), (7, 10), (10, 10), (25, 10), (1237, 100)])
            def test_returns_every_item(total, page_size):
                fetch, _ = fake_api(total)
                numbers = [item["number"] for item in OffsetPaginator(fetch, page_size=page_size)]
        >       assert numbers == [f"INV-{i:04d}" for i in range(1, total + 1)]
        E       AssertionError: assert ['INV-0001', ...'INV-0020'] == ['INV-0001', ...'INV-0025']
        E         Right contains 5 more items, first extra item: 'INV-0021'
        E         Use -v to get more diff

        tests/test_pagination.py:20: AssertionError
        ____________________ test_returns_every_item[1237-100] ____________________
        E       AssertionError: assert ['INV-0001', ...'INV-1200'] == ['INV-0001', ...'INV-1237']
        E         Right contains 37 more items, first extra item: 'INV-1201'
        tests/test_pagination.py:20: AssertionError
        =========================== short test summary info ============================
        FAILED tests/test_pagination.py::test_returns_every_item[25-10] - AssertionError
        FAILED tests/test_pagination.py::test_returns_every_item[1237-100] - AssertionError
        2 failed, 4 passed in 0.21s
    """),
    commits=[
        "9c1e4ab Fix Retry-After parsing for HTTP-date values",
        "52f07d3 Release 2.4.0",
        "e81b2c0 Paginate by offsets computed from the first page's total",
        "0d7aa61 Accept page_size in list_invoices/iter_invoices",
    ],
)

# ------------------------------------------------------------------------------------------------ Python: DST
scenario(
    repo="tidewater/tzcron",
    lang="Python",
    test_cmd="python -m pytest -q",
    title="Daily job fires at the wrong hour for a week after the DST change",
    issue=dedent("""
        We schedule a report with `Schedule.daily(at="07:30", tz="America/New_York")`. Since Sunday (the spring
        DST change, clocks went from 02:00 to 03:00) the report arrives at 08:30 local time instead of 07:30.
        Restarting the scheduler fixes it until the next transition; in November it arrived at 06:30 instead.

        I looked at `next_fire_time()`: it adds `timedelta(days=1)` to the previous fire time. Since 0.9.0 the
        runner keeps due times in UTC ("compare in UTC" in the changelog), so the previous fire time it passes
        in is a UTC datetime, and adding a day to it keeps the UTC time fixed while the local time moves by an
        hour. For a daily job the wall-clock time should stay at 07:30 local time whatever the UTC offset is.

        There is also an edge case I am not sure how you want to handle: a daily job at 02:30 on the spring
        change day -- that wall time does not exist. cron runs it at 03:30 (or skips it, depending on the
        implementation). Whatever you choose, please document it. And on the autumn change day 01:30 occurs
        twice; it should run once.

        Versions: tzcron 0.9.3, Python 3.12.1, the scheduler runs in a container with TZ=UTC.
    """),
    tree=dedent("""
        tzcron/
        ├── pyproject.toml
        ├── README.md
        ├── tzcron/
        │   ├── __init__.py
        │   ├── schedule.py
        │   ├── runner.py
        │   └── clock.py
        └── tests/
            ├── test_schedule.py
            └── test_runner.py
    """),
    files=[
        ("tzcron/schedule.py", dedent('''
            from __future__ import annotations

            from dataclasses import dataclass
            from datetime import datetime, time, timedelta
            from zoneinfo import ZoneInfo


            @dataclass(frozen=True)
            class Schedule:
                """When a job runs. Only fixed intervals and daily/weekly wall-clock times are supported."""

                interval: timedelta | None = None
                at: time | None = None
                weekdays: frozenset[int] = frozenset(range(7))
                tz: ZoneInfo = ZoneInfo("UTC")

                @classmethod
                def every(cls, **kwargs: float) -> "Schedule":
                    return cls(interval=timedelta(**kwargs))

                @classmethod
                def daily(cls, at: str, tz: str = "UTC") -> "Schedule":
                    hour, minute = (int(part) for part in at.split(":"))
                    return cls(at=time(hour, minute), tz=ZoneInfo(tz))

                @classmethod
                def weekly(cls, days: list[int], at: str, tz: str = "UTC") -> "Schedule":
                    base = cls.daily(at, tz)
                    return cls(at=base.at, weekdays=frozenset(days), tz=base.tz)

                def first_fire_time(self, now: datetime) -> datetime:
                    """The first fire time strictly after ``now`` (an aware datetime)."""
                    if self.interval is not None:
                        return now + self.interval
                    local = now.astimezone(self.tz)
                    candidate = local.replace(hour=self.at.hour, minute=self.at.minute, second=0, microsecond=0)
                    if candidate <= local:
                        candidate += timedelta(days=1)
                    while candidate.weekday() not in self.weekdays:
                        candidate += timedelta(days=1)
                    return candidate

                def next_fire_time(self, previous: datetime) -> datetime:
                    """The fire time that follows ``previous``, the last one we fired at."""
                    if self.interval is not None:
                        return previous + self.interval
                    candidate = previous + timedelta(days=1)
                    while candidate.weekday() not in self.weekdays:
                        candidate += timedelta(days=1)
                    return candidate
        ''')),
        ("tzcron/runner.py", dedent('''
            from __future__ import annotations

            import heapq
            import logging
            from dataclasses import dataclass, field
            from datetime import datetime, timezone
            from typing import Callable

            from .clock import Clock, SystemClock
            from .schedule import Schedule

            log = logging.getLogger(__name__)


            @dataclass(order=True)
            class _Entry:
                due: datetime
                name: str = field(compare=False)
                schedule: Schedule = field(compare=False)
                func: Callable[[], None] = field(compare=False)


            class Runner:
                def __init__(self, clock: Clock | None = None) -> None:
                    self._clock = clock or SystemClock()
                    self._queue: list[_Entry] = []

                def add(self, name: str, schedule: Schedule, func: Callable[[], None]) -> datetime:
                    # Keep every due time in UTC: comparing datetimes with different tzinfo objects in the heap
                    # is slow and makes the log lines hard to read.
                    due = schedule.first_fire_time(self._clock.now()).astimezone(timezone.utc)
                    heapq.heappush(self._queue, _Entry(due, name, schedule, func))
                    log.info("scheduled %s at %s", name, due.isoformat())
                    return due

                def run_pending(self) -> int:
                    """Run every job that is due; returns how many ran."""
                    ran = 0
                    now = self._clock.now()
                    while self._queue and self._queue[0].due <= now:
                        entry = heapq.heappop(self._queue)
                        try:
                            entry.func()
                        except Exception:
                            log.exception("job %s failed", entry.name)
                        ran += 1
                        entry.due = entry.schedule.next_fire_time(entry.due).astimezone(timezone.utc)
                        heapq.heappush(self._queue, entry)
                    return ran

                def run_forever(self) -> None:
                    while True:
                        self.run_pending()
                        if self._queue:
                            self._clock.sleep_until(self._queue[0].due)
                        else:
                            self._clock.sleep(1.0)
        ''')),
        ("tzcron/clock.py", dedent('''
            from __future__ import annotations

            import time as _time
            from datetime import datetime, timezone
            from typing import Protocol


            class Clock(Protocol):
                def now(self) -> datetime: ...
                def sleep(self, seconds: float) -> None: ...
                def sleep_until(self, when: datetime) -> None: ...


            class SystemClock:
                def now(self) -> datetime:
                    return datetime.now(timezone.utc)

                def sleep(self, seconds: float) -> None:
                    _time.sleep(max(0.0, seconds))

                def sleep_until(self, when: datetime) -> None:
                    self.sleep((when - self.now()).total_seconds())
        ''')),
    ],
    trace=dedent("""
        $ python reproduce.py
        INFO tzcron.runner: scheduled report at 2024-03-08T12:30:00+00:00
        due (UTC)                   local (America/New_York)
        2024-03-08 12:30:00+00:00   2024-03-08 07:30 EST
        2024-03-09 12:30:00+00:00   2024-03-09 07:30 EST
        2024-03-10 12:30:00+00:00   2024-03-10 08:30 EDT   <- should be 07:30 EDT = 11:30 UTC
        2024-03-11 12:30:00+00:00   2024-03-11 08:30 EDT
        2024-03-12 12:30:00+00:00   2024-03-12 08:30 EDT
    """),
    test=("tests/test_schedule.py", dedent('''
        from datetime import datetime
        from zoneinfo import ZoneInfo

        from tzcron.schedule import Schedule

        NY = ZoneInfo("America/New_York")
        UTC = ZoneInfo("UTC")


        def walk(schedule, start, count):
            # The runner stores due times in UTC, so that is what next_fire_time() receives.
            times = [schedule.first_fire_time(start).astimezone(UTC)]
            for _ in range(count - 1):
                times.append(schedule.next_fire_time(times[-1]).astimezone(UTC))
            return [t.astimezone(NY).strftime("%Y-%m-%d %H:%M") for t in times]


        def test_daily_keeps_wall_time_across_spring_forward():
            start = datetime(2024, 3, 8, 12, 0, tzinfo=ZoneInfo("UTC"))
            assert walk(Schedule.daily("07:30", "America/New_York"), start, 4) == [
                "2024-03-08 07:30", "2024-03-09 07:30", "2024-03-10 07:30", "2024-03-11 07:30",
            ]


        def test_daily_keeps_wall_time_across_fall_back():
            start = datetime(2024, 11, 1, 12, 0, tzinfo=ZoneInfo("UTC"))
            assert walk(Schedule.daily("07:30", "America/New_York"), start, 3) == [
                "2024-11-02 07:30", "2024-11-03 07:30", "2024-11-04 07:30",
            ]


        def test_interval_is_absolute():
            start = datetime(2024, 3, 10, 6, 0, tzinfo=ZoneInfo("UTC"))
            s = Schedule.every(hours=6)
            assert (s.next_fire_time(s.first_fire_time(start)) - start).total_seconds() == 12 * 3600
    ''')),
    test_output=dedent("""
        $ python -m pytest -q tests/test_schedule.py
        FF.                                                                      [100%]
        =================================== FAILURES ===================================
        _______________ test_daily_keeps_wall_time_across_spring_forward _______________
        >       assert walk(Schedule.daily("07:30", "America/New_York"), start, 4) == [
        E       AssertionError: assert ['2024-03-08 ...-03-11 08:30'] == ['2024-03-08 ...-03-11 07:30']
        E         At index 2 diff: '2024-03-10 08:30' != '2024-03-10 07:30'
        tests/test_schedule.py:21: AssertionError
        ________________ test_daily_keeps_wall_time_across_fall_back __________________
        >       assert walk(Schedule.daily("07:30", "America/New_York"), start, 3) == [
        E       AssertionError: assert ['2024-11-02 ...-11-04 06:30'] == ['2024-11-02 ...-11-04 07:30']
        E         At index 1 diff: '2024-11-03 06:30' != '2024-11-03 07:30'
        tests/test_schedule.py:29: AssertionError
        =========================== short test summary info ============================
        FAILED tests/test_schedule.py::test_daily_keeps_wall_time_across_spring_forward
        FAILED tests/test_schedule.py::test_daily_keeps_wall_time_across_fall_back
        2 failed, 1 passed in 0.09s
    """),
    commits=[
        "c44d0b2 runner: keep due times in UTC (compare in UTC)",
        "3f2a9e1 runner: use a heap instead of sorting on every tick",
        "a7c01d4 schedule: add weekly()",
        "1bd93e0 Switch from pytz to zoneinfo",
    ],
)

# ------------------------------------------------------------------------------------------------ Python: CSV BOM
scenario(
    repo="fieldnote-labs/rowpipe",
    lang="Python",
    test_cmd="python -m pytest -q tests/",
    title="KeyError: 'id' when importing a CSV exported from Excel",
    issue=dedent("""
        Importing a CSV that was saved from Excel ("CSV UTF-8 (Comma delimited)") fails immediately with
        `KeyError: 'id'`, although the first column header is clearly `id`. The same file re-saved from
        LibreOffice imports fine, and so does a copy where I retyped the header line by hand.

        `rowpipe inspect` prints the header as `['id', 'name', 'email', 'signup_date']`, which is confusing,
        but `repr()` of the first key shows `'\\ufeffid'`: Excel writes a UTF-8 byte order mark at the start of
        the file, and we open the file with `encoding="utf-8"`, which keeps the BOM as part of the first field.

        Expected: the BOM is ignored. Files without a BOM must keep working, and so must files in other
        encodings passed with `--encoding latin-1`. Files that arrive through `rowpipe import -` (stdin) are
        affected too, since some of our users pipe the export from `curl`.

        Side note: the error message is unhelpful. When a required column is missing, it would be nice to say
        which columns *were* found (with `repr`, so invisible characters show up).
    """),
    tree=dedent("""
        rowpipe/
        ├── pyproject.toml
        ├── rowpipe/
        │   ├── __init__.py
        │   ├── cli.py
        │   ├── readers.py
        │   ├── schema.py
        │   └── sinks/
        │       ├── __init__.py
        │       ├── postgres.py
        │       └── jsonl.py
        └── tests/
            ├── data/
            │   ├── customers.csv
            │   └── customers_latin1.csv
            ├── test_cli.py
            └── test_readers.py
    """),
    files=[
        ("rowpipe/readers.py", dedent('''
            from __future__ import annotations

            import csv
            import io
            import sys
            from pathlib import Path
            from typing import IO, Iterator

            from .schema import Schema, SchemaError


            def open_source(path: str, encoding: str = "utf-8") -> IO[str]:
                """Open a file path, or standard input for "-", as text."""
                if path == "-":
                    return io.TextIOWrapper(sys.stdin.buffer, encoding=encoding, newline="")
                return Path(path).open("r", encoding=encoding, newline="")


            def sniff_dialect(sample: str) -> type[csv.Dialect]:
                try:
                    return csv.Sniffer().sniff(sample, delimiters=",;\\t|")
                except csv.Error:
                    return csv.excel


            def read_rows(handle: IO[str], schema: Schema) -> Iterator[dict[str, object]]:
                sample = handle.read(64 * 1024)
                handle.seek(0) if handle.seekable() else None
                dialect = sniff_dialect(sample)
                source = handle if handle.seekable() else io.StringIO(sample + handle.read())
                reader = csv.DictReader(source, dialect=dialect)
                header = [name.strip() for name in reader.fieldnames or []]
                reader.fieldnames = header
                schema.check_header(header)
                for line_number, raw in enumerate(reader, start=2):
                    try:
                        yield schema.convert(raw)
                    except SchemaError as error:
                        raise SchemaError(f"line {line_number}: {error}") from None
        ''')),
        ("rowpipe/schema.py", dedent('''
            from __future__ import annotations

            from dataclasses import dataclass, field
            from datetime import date
            from typing import Callable


            class SchemaError(ValueError):
                pass


            CONVERTERS: dict[str, Callable[[str], object]] = {
                "str": str,
                "int": int,
                "float": float,
                "date": date.fromisoformat,
                "bool": lambda text: text.strip().lower() in {"1", "true", "yes", "y"},
            }


            @dataclass
            class Column:
                name: str
                type: str = "str"
                required: bool = True


            @dataclass
            class Schema:
                columns: list[Column] = field(default_factory=list)

                def check_header(self, header: list[str]) -> None:
                    for column in self.columns:
                        if column.required and column.name not in header:
                            raise KeyError(column.name)

                def convert(self, raw: dict[str, str]) -> dict[str, object]:
                    row: dict[str, object] = {}
                    for column in self.columns:
                        text = raw[column.name]
                        if text == "" and not column.required:
                            row[column.name] = None
                            continue
                        try:
                            row[column.name] = CONVERTERS[column.type](text)
                        except ValueError as error:
                            raise SchemaError(f"column {column.name!r}: {error}") from None
                    return row
        ''')),
        ("rowpipe/cli.py", dedent('''
            import argparse
            import sys

            from .readers import open_source, read_rows
            from .schema import Column, Schema
            from .sinks import get_sink


            def main(argv: list[str] | None = None) -> int:
                parser = argparse.ArgumentParser(prog="rowpipe")
                sub = parser.add_subparsers(dest="command", required=True)
                imp = sub.add_parser("import", help="import a CSV file into a sink")
                imp.add_argument("path", help="CSV file, or - for standard input")
                imp.add_argument("--schema", required=True, help="schema file (TOML)")
                imp.add_argument("--sink", default="jsonl:-")
                imp.add_argument("--encoding", default="utf-8")
                args = parser.parse_args(argv)

                schema = Schema.from_toml(args.schema)
                sink = get_sink(args.sink)
                with open_source(args.path, args.encoding) as handle:
                    count = 0
                    for row in read_rows(handle, schema):
                        sink.write(row)
                        count += 1
                sink.close()
                print(f"imported {count} rows", file=sys.stderr)
                return 0
        ''')),
    ],
    trace=dedent("""
        $ rowpipe import exports/customers_2024-05.csv --schema customers.toml --sink postgres://crm/customers
        Traceback (most recent call last):
          File "/opt/venv/bin/rowpipe", line 8, in <module>
            sys.exit(main())
                     ^^^^^^
          File "/opt/venv/lib/python3.11/site-packages/rowpipe/cli.py", line 24, in main
            for row in read_rows(handle, schema):
          File "/opt/venv/lib/python3.11/site-packages/rowpipe/readers.py", line 32, in read_rows
            schema.check_header(header)
          File "/opt/venv/lib/python3.11/site-packages/rowpipe/schema.py", line 38, in check_header
            raise KeyError(column.name)
        KeyError: 'id'

        $ head -c 16 exports/customers_2024-05.csv | xxd
        00000000: efbb bf69 642c 6e61 6d65 2c65 6d61 696c  ...id,name,email
    """),
    test=("tests/test_readers.py", dedent('''
        import io

        import pytest

        from rowpipe.readers import read_rows
        from rowpipe.schema import Column, Schema

        SCHEMA = Schema([Column("id", "int"), Column("name"), Column("email", required=False)])


        def rows(data: bytes, encoding="utf-8"):
            handle = io.TextIOWrapper(io.BytesIO(data), encoding=encoding, newline="")
            return list(read_rows(handle, SCHEMA))


        def test_plain_utf8():
            assert rows(b"id,name,email\\n1,Ada,ada@example.com\\n") == [
                {"id": 1, "name": "Ada", "email": "ada@example.com"}
            ]


        def test_utf8_with_bom():
            data = "\\ufeffid,name,email\\n2,Grace,\\n".encode("utf-8")
            assert rows(data) == [{"id": 2, "name": "Grace", "email": None}]


        def test_latin1():
            data = "id;name;email\\n3;Zoë;z@example.com\\n".encode("latin-1")
            assert rows(data, "latin-1")[0]["name"] == "Zoë"


        def test_missing_column_lists_found_columns():
            with pytest.raises(KeyError, match=r"found \\['uid', 'name'\\]"):
                rows(b"uid,name\\n1,Ada\\n")
    ''')),
    test_output=dedent("""
        $ python -m pytest -q tests/test_readers.py
        .F.F                                                                     [100%]
        =================================== FAILURES ===================================
        ______________________________ test_utf8_with_bom ______________________________
        rowpipe/readers.py:32: in read_rows
            schema.check_header(header)
        rowpipe/schema.py:38: in check_header
            raise KeyError(column.name)
        E   KeyError: 'id'
        __________________ test_missing_column_lists_found_columns ____________________
        E   AssertionError: Regex pattern did not match.
        E    Regex: "found \\\\['uid', 'name'\\\\]"
        E    Input: "'id'"
        =========================== short test summary info ============================
        FAILED tests/test_readers.py::test_utf8_with_bom - KeyError: 'id'
        FAILED tests/test_readers.py::test_missing_column_lists_found_columns - AssertionError
        2 failed, 2 passed in 0.12s
    """),
    commits=[
        "b7e2f10 sinks: batch inserts into postgres (500 rows per statement)",
        "8a03c9d readers: sniff delimiter from the first 64 KiB",
        "4d1e0aa cli: accept - for stdin",
    ],
)

# ------------------------------------------------------------------------------------------------ Python: money
scenario(
    repo="pennyworth/cartkit",
    lang="Python",
    test_cmd="python -m pytest -q tests/test_pricing.py",
    title="Order totals are off by one cent compared with the invoice PDF",
    issue=dedent("""
        Our accountant found 214 orders in March where the total stored on the order is one cent lower than the
        total on the invoice PDF (the PDF is rendered by a separate service that uses `Decimal` everywhere).
        Example: 3 x "Beeswax wrap, large" at 8.50 EUR net, 19% VAT (exactly 30.345 gross).

        * cartkit order total: 30.34
        * invoice PDF:         30.35

        As far as I can tell `line_total()` multiplies floats and then calls `round(x, 2)`. Python's `round()`
        uses round-half-to-even, and float representation makes it worse (`round(2.675, 2) == 2.67`). Our
        business rule (and the tax office's) is commercial rounding: half up, per line, after tax.

        We also apply percentage discounts (`apply_discount`) and the same problem shows up there: 15% off
        19.90 gives 16.91 in cartkit, 16.92 on the PDF (16.915 rounded half up).

        Could `cartkit.pricing` use `Decimal` with `ROUND_HALF_UP` consistently? The public functions accept
        and return floats today; returning `Decimal` would be a breaking change for us too, so maybe accept both
        and keep returning the same type you were given? Open to suggestions.
    """),
    tree=dedent("""
        cartkit/
        ├── cartkit/
        │   ├── __init__.py
        │   ├── cart.py
        │   ├── pricing.py
        │   ├── tax.py
        │   └── money.py
        ├── docs/pricing.md
        └── tests/
            ├── test_cart.py
            └── test_pricing.py
    """),
    files=[
        ("cartkit/pricing.py", dedent('''
            """Price arithmetic for carts and orders. All amounts are in the currency's major unit."""

            from __future__ import annotations

            from .tax import TaxRate


            def apply_discount(price: float, percent: float) -> float:
                if not 0 <= percent <= 100:
                    raise ValueError(f"discount must be between 0 and 100, got {percent}")
                return round(price * (1 - percent / 100), 2)


            def line_total(unit_net: float, quantity: int, tax: TaxRate) -> float:
                """Gross total of one order line: net price times quantity, plus tax, rounded to cents."""
                if quantity <= 0:
                    raise ValueError("quantity must be positive")
                net = unit_net * quantity
                return round(net * (1 + tax.rate), 2)


            def order_total(lines: list[tuple[float, int, TaxRate]], shipping: float = 0.0) -> float:
                return round(sum(line_total(*line) for line in lines) + shipping, 2)


            def split_evenly(amount: float, parts: int) -> list[float]:
                """Split an amount into ``parts`` shares that add up exactly (first shares get the extra cents)."""
                cents = int(round(amount * 100))
                base, extra = divmod(cents, parts)
                return [(base + (1 if i < extra else 0)) / 100 for i in range(parts)]
        ''')),
        ("cartkit/tax.py", dedent('''
            from dataclasses import dataclass


            @dataclass(frozen=True)
            class TaxRate:
                name: str
                rate: float  # 0.19 for 19 %

                def __post_init__(self) -> None:
                    if not 0 <= self.rate < 1:
                        raise ValueError(f"tax rate must be a fraction, got {self.rate}")


            STANDARD_DE = TaxRate("DE standard", 0.19)
            REDUCED_DE = TaxRate("DE reduced", 0.07)
            STANDARD_FR = TaxRate("FR standard", 0.20)
        ''')),
        ("cartkit/money.py", dedent('''
            from decimal import ROUND_HALF_UP, Decimal

            CENT = Decimal("0.01")


            def to_decimal(value) -> Decimal:
                """Convert a float, int, str or Decimal to Decimal without binary float artefacts."""
                if isinstance(value, Decimal):
                    return value
                if isinstance(value, float):
                    return Decimal(repr(value))
                return Decimal(value)


            def quantize(value: Decimal) -> Decimal:
                return value.quantize(CENT, rounding=ROUND_HALF_UP)
        ''')),
        ("docs/pricing.md", dedent('''
            # Pricing

            cartkit computes prices per order line: net unit price x quantity, then tax, then rounding to
            cents. Amounts are passed as floats for convenience. Discounts are applied to the net unit price
            before tax. `split_evenly` is used for instalments and always adds up to the original amount.
        ''')),
    ],
    trace=dedent("""
        >>> from cartkit.pricing import line_total, apply_discount
        >>> from cartkit.tax import STANDARD_DE
        >>> line_total(8.50, 3, STANDARD_DE)           # 25.50 * 1.19 = 30.345 -> PDF says 30.35
        30.34
        >>> 8.50 * 3 * (1 + 0.19)
        30.345
        >>> from decimal import Decimal
        >>> Decimal(8.50 * 3 * (1 + 0.19))                # the float is just below .345
        Decimal('30.344999999999998863131622783839702606201171875')
        >>> Decimal("8.50") * 3 * Decimal("1.19")
        Decimal('30.3450')
        >>> apply_discount(19.90, 15)                  # 16.915 -> expected 16.92
        16.91
        >>> 19.90 * 0.85
        16.915000000000003
        >>> round(2.675, 2)
        2.67
    """),
    test=("tests/test_pricing.py", dedent('''
        from decimal import Decimal

        import pytest

        from cartkit.pricing import apply_discount, line_total, order_total, split_evenly
        from cartkit.tax import REDUCED_DE, STANDARD_DE


        @pytest.mark.parametrize("price,percent,expected", [
            (19.90, 15, 16.92),
            (2.675, 0, 2.68),
            (10.00, 33, 6.70),
        ])
        def test_discount_rounds_half_up(price, percent, expected):
            assert apply_discount(price, percent) == expected


        def test_line_total_half_up():
            assert line_total(1.125, 2, REDUCED_DE) == 2.41   # 2.25 * 1.07 = 2.4075


        def test_decimal_in_decimal_out():
            result = line_total(Decimal("8.50"), 3, STANDARD_DE)
            assert isinstance(result, Decimal) and result == Decimal("30.35")


        def test_split_adds_up():
            assert sum(split_evenly(100.00, 3)) == pytest.approx(100.00)
            assert split_evenly(100.00, 3) == [33.34, 33.33, 33.33]
    ''')),
    test_output=dedent("""
        $ python -m pytest -q tests/test_pricing.py
        FF..F.                                                                   [100%]
        =================================== FAILURES ===================================
        __________________ test_discount_rounds_half_up[19.9-15-16.92] __________________
        E       assert 16.91 == 16.92
        E        +  where 16.91 = apply_discount(19.9, 15)
        ___________________ test_discount_rounds_half_up[2.675-0-2.68] __________________
        E       assert 2.67 == 2.68
        E        +  where 2.67 = apply_discount(2.675, 0)
        ____________________________ test_decimal_in_decimal_out ____________________________
            def line_total(unit_net: float, quantity: int, tax: TaxRate) -> float:
                net = unit_net * quantity
        >       return round(net * (1 + tax.rate), 2)
        E       TypeError: unsupported operand type(s) for *: 'decimal.Decimal' and 'float'
        cartkit/pricing.py:20: TypeError
        =========================== short test summary info ============================
        FAILED tests/test_pricing.py::test_discount_rounds_half_up[19.9-15-16.92]
        FAILED tests/test_pricing.py::test_discount_rounds_half_up[2.675-0-2.68]
        FAILED tests/test_pricing.py::test_decimal_in_decimal_out - TypeError
        3 failed, 3 passed in 0.14s
    """),
    commits=[
        "e02b7c9 Add money.to_decimal and quantize helpers (unused yet)",
        "71ad3f4 split_evenly: distribute leftover cents to the first shares",
        "c90f1b2 tax: add FR standard rate",
    ],
)

# ------------------------------------------------------------------------------------------------ Python: asyncio
scenario(
    repo="harborlight/taskferry",
    lang="Python",
    test_cmd="python -m pytest -q tests/test_pool.py -p no:randomly",
    title="WorkerPool hangs forever after a few tasks raise",
    issue=dedent("""
        ### Summary
        `WorkerPool.map()` stops making progress after several submitted coroutines raise an exception. With
        `max_concurrency=4`, once four tasks have failed the pool hangs: no CPU use, no more requests, and the
        `await pool.map(...)` never returns. Ctrl-C shows every worker waiting in `Semaphore.acquire()`.

        ### Reproduction
        ```python
        import asyncio
        from taskferry import WorkerPool

        async def job(i):
            await asyncio.sleep(0.01)
            if i % 3 == 0:
                raise RuntimeError(f"boom {i}")
            return i

        async def main():
            pool = WorkerPool(max_concurrency=4, return_exceptions=True)
            results = await pool.map(job, range(20))
            print(results)

        asyncio.run(main())   # never finishes
        ```

        ### Expected
        With `return_exceptions=True` the 20 results come back, the failed ones as exception objects, like
        `asyncio.gather(..., return_exceptions=True)`. With `return_exceptions=False` the first exception should
        propagate and the remaining tasks should be cancelled, not left running in the background.

        ### Notes
        We also see `Task was destroyed but it is pending!` warnings at interpreter exit when a task times
        out, which may be the same problem (`timeout=` per task). taskferry 1.3.0, Python 3.12.3.
    """),
    tree=dedent("""
        taskferry/
        ├── pyproject.toml
        ├── src/taskferry/
        │   ├── __init__.py
        │   ├── pool.py
        │   ├── ratelimit.py
        │   └── metrics.py
        └── tests/
            ├── test_pool.py
            └── test_ratelimit.py
    """),
    files=[
        ("src/taskferry/pool.py", dedent('''
            from __future__ import annotations

            import asyncio
            import logging
            from typing import Any, Awaitable, Callable, Iterable, TypeVar

            from .metrics import PoolMetrics

            T = TypeVar("T")
            R = TypeVar("R")

            log = logging.getLogger(__name__)


            class WorkerPool:
                """Run coroutines with bounded concurrency, optionally with a per-task timeout."""

                def __init__(
                    self,
                    max_concurrency: int = 8,
                    timeout: float | None = None,
                    return_exceptions: bool = False,
                    metrics: PoolMetrics | None = None,
                ) -> None:
                    if max_concurrency < 1:
                        raise ValueError("max_concurrency must be at least 1")
                    self._semaphore = asyncio.Semaphore(max_concurrency)
                    self._timeout = timeout
                    self._return_exceptions = return_exceptions
                    self.metrics = metrics or PoolMetrics()

                async def _run_one(self, func: Callable[[T], Awaitable[R]], item: T) -> R:
                    await self._semaphore.acquire()
                    self.metrics.in_flight += 1
                    if self._timeout is not None:
                        result = await asyncio.wait_for(func(item), self._timeout)
                    else:
                        result = await func(item)
                    self.metrics.in_flight -= 1
                    self.metrics.completed += 1
                    self._semaphore.release()
                    return result

                async def map(self, func: Callable[[T], Awaitable[R]], items: Iterable[T]) -> list[R | BaseException]:
                    tasks = [asyncio.ensure_future(self._run_one(func, item)) for item in items]
                    results = await asyncio.gather(*tasks, return_exceptions=self._return_exceptions)
                    return list(results)

                async def submit(self, func: Callable[..., Awaitable[Any]], *args: Any) -> asyncio.Task:
                    return asyncio.ensure_future(self._run_one(lambda _: func(*args), None))
        ''')),
        ("src/taskferry/metrics.py", dedent('''
            from dataclasses import dataclass


            @dataclass
            class PoolMetrics:
                in_flight: int = 0
                completed: int = 0
                failed: int = 0
                timed_out: int = 0

                def snapshot(self) -> dict[str, int]:
                    return {
                        "in_flight": self.in_flight,
                        "completed": self.completed,
                        "failed": self.failed,
                        "timed_out": self.timed_out,
                    }
        ''')),
        ("src/taskferry/ratelimit.py", dedent('''
            import asyncio
            import time


            class TokenBucket:
                """Allow `rate` acquisitions per second on average, with bursts up to `capacity`."""

                def __init__(self, rate: float, capacity: int) -> None:
                    self.rate = rate
                    self.capacity = capacity
                    self._tokens = float(capacity)
                    self._updated = time.monotonic()
                    self._lock = asyncio.Lock()

                async def acquire(self) -> None:
                    async with self._lock:
                        while True:
                            now = time.monotonic()
                            self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate)
                            self._updated = now
                            if self._tokens >= 1:
                                self._tokens -= 1
                                return
                            await asyncio.sleep((1 - self._tokens) / self.rate)
        ''')),
    ],
    trace=dedent("""
        $ timeout -s INT 10 python repro.py
        ^CTraceback (most recent call last):
          File "/work/repro.py", line 17, in <module>
            asyncio.run(main())
          File "/usr/lib/python3.12/asyncio/runners.py", line 194, in run
            return runner.run(main)
          File "/usr/lib/python3.12/asyncio/runners.py", line 118, in run
            return self._loop.run_until_complete(task)
          File "/usr/lib/python3.12/asyncio/base_events.py", line 674, in run_until_complete
            self.run_forever()
        KeyboardInterrupt
        Task pending name='Task-9' coro=<WorkerPool._run_one() running at src/taskferry/pool.py:33>
            wait_for=<Future pending cb=[Task.task_wakeup()]>
        Task pending name='Task-10' coro=<WorkerPool._run_one() running at src/taskferry/pool.py:33>
            wait_for=<Future pending cb=[Task.task_wakeup()]>
        ... (12 more tasks pending in Semaphore.acquire)
        metrics: {'in_flight': 4, 'completed': 5, 'failed': 0, 'timed_out': 0}
    """),
    test=("tests/test_pool.py", dedent('''
        import asyncio

        import pytest

        from taskferry import WorkerPool


        async def flaky(i):
            await asyncio.sleep(0.001)
            if i % 3 == 0:
                raise RuntimeError(f"boom {i}")
            return i


        @pytest.mark.timeout(5)
        async def test_failures_release_slots():
            pool = WorkerPool(max_concurrency=2, return_exceptions=True)
            results = await pool.map(flaky, range(12))
            assert [r for r in results if not isinstance(r, Exception)] == [1, 2, 4, 5, 7, 8, 10, 11]
            assert pool.metrics.in_flight == 0
            assert pool.metrics.failed == 4


        @pytest.mark.timeout(5)
        async def test_timeouts_release_slots():
            async def slow(i):
                await asyncio.sleep(1 if i < 2 else 0)
                return i

            pool = WorkerPool(max_concurrency=2, timeout=0.05, return_exceptions=True)
            results = await pool.map(slow, range(6))
            assert sum(isinstance(r, asyncio.TimeoutError) for r in results) == 2
            assert pool.metrics.timed_out == 2
    ''')),
    test_output=dedent("""
        $ python -m pytest -q tests/test_pool.py -p no:randomly
        FF                                                                       [100%]
        =================================== FAILURES ===================================
        _________________________ test_failures_release_slots __________________________
        +++++++++++++++++++++++++++++++++++ Timeout ++++++++++++++++++++++++++++++++++++
        ~~~~~~~~~~~~~~~~~~~~~ Stack of asyncio_0 (140264417326784) ~~~~~~~~~~~~~~~~~~~~~
          File "/usr/lib/python3.12/asyncio/base_events.py", line 1949, in _run_once
            event_list = self._selector.select(timeout)
          File "/usr/lib/python3.12/selectors.py", line 468, in select
            fd_event_list = self._selector.poll(timeout, max_ev)
        +++++++++++++++++++++++++++++++++++ Timeout ++++++++++++++++++++++++++++++++++++
        E   Failed: Timeout >5.0s
        _________________________ test_timeouts_release_slots __________________________
        E   Failed: Timeout >5.0s
        =========================== short test summary info ============================
        FAILED tests/test_pool.py::test_failures_release_slots - Failed: Timeout >5.0s
        FAILED tests/test_pool.py::test_timeouts_release_slots - Failed: Timeout >5.0s
        2 failed in 10.31s
    """),
    commits=[
        "5b0c2e8 Add PoolMetrics with in_flight/completed counters",
        "ee41a90 pool: per-task timeout via asyncio.wait_for",
        "02c7d1f Add TokenBucket rate limiter",
    ],
)

# ------------------------------------------------------------------------------------------------ Python: config merge
scenario(
    repo="northbeam/layercake",
    lang="Python",
    test_cmd="python -m pytest -q",
    title="Settings from one environment leak into the next load_config() call",
    issue=dedent("""
        In our test suite we call `load_config("staging")` and `load_config("production")` in the same process.
        The second call returns `database.pool_size = 40`, which is only set in `staging.yaml`;
        `production.yaml` does not mention `pool_size`, so it should fall back to the default of 10.
        Calling them in the opposite order gives correct production values but wrong staging values for
        `features.beta_banner`.

        Looks like `deep_merge()` writes into the dictionaries it was given. `DEFAULTS` is a module-level dict,
        so the first environment's overrides end up in `DEFAULTS["database"]` and stay there for every later
        call. `copy.copy(DEFAULTS)` at the top of `load_config` only copies the outer dictionary.

        In production this does not bite because each process loads one environment, but we have a migration
        tool that loads every environment to compare them, and it printed the wrong pool sizes for three of
        the five environments. Lists are affected too: `allowed_hosts` from one file gets extended by the
        next one instead of replaced (our docs say lists are replaced, not concatenated).

        layercake 0.7.2, PyYAML 6.0.1, Python 3.11.
    """),
    tree=dedent("""
        layercake/
        ├── layercake/
        │   ├── __init__.py
        │   ├── loader.py
        │   ├── merge.py
        │   ├── defaults.py
        │   └── env.py
        ├── docs/merging.md
        └── tests/
            ├── fixtures/
            │   ├── production.yaml
            │   └── staging.yaml
            ├── test_loader.py
            └── test_merge.py
    """),
    files=[
        ("layercake/merge.py", dedent('''
            from __future__ import annotations

            from typing import Any, Mapping, MutableMapping


            def deep_merge(base: MutableMapping[str, Any], override: Mapping[str, Any]) -> MutableMapping[str, Any]:
                """Merge ``override`` into ``base``: mappings are merged recursively, lists are extended and
                everything else is replaced. Returns the merged mapping."""
                for key, value in override.items():
                    current = base.get(key)
                    if isinstance(current, MutableMapping) and isinstance(value, Mapping):
                        deep_merge(current, value)
                    elif isinstance(current, list) and isinstance(value, list):
                        current.extend(value)
                    else:
                        base[key] = value
                return base
        ''')),
        ("layercake/loader.py", dedent('''
            from __future__ import annotations

            import copy
            import os
            from pathlib import Path
            from typing import Any

            import yaml

            from .defaults import DEFAULTS
            from .env import apply_env_overrides
            from .merge import deep_merge

            CONFIG_DIR = Path(os.environ.get("LAYERCAKE_CONFIG_DIR", "config"))


            class ConfigError(Exception):
                pass


            def read_yaml(path: Path) -> dict[str, Any]:
                try:
                    with path.open() as handle:
                        data = yaml.safe_load(handle) or {}
                except FileNotFoundError:
                    raise ConfigError(f"no configuration file {path}") from None
                if not isinstance(data, dict):
                    raise ConfigError(f"{path}: top level must be a mapping")
                return data


            def load_config(environment: str, config_dir: Path | None = None) -> dict[str, Any]:
                directory = config_dir or CONFIG_DIR
                config = copy.copy(DEFAULTS)
                base_file = directory / "base.yaml"
                if base_file.exists():
                    deep_merge(config, read_yaml(base_file))
                deep_merge(config, read_yaml(directory / f"{environment}.yaml"))
                apply_env_overrides(config, prefix="APP_")
                config["environment"] = environment
                return config
        ''')),
        ("layercake/defaults.py", dedent('''
            DEFAULTS = {
                "debug": False,
                "database": {"host": "localhost", "port": 5432, "pool_size": 10, "timeout_s": 5},
                "cache": {"backend": "memory", "ttl_s": 300},
                "features": {"beta_banner": False, "new_checkout": False},
                "allowed_hosts": ["localhost"],
            }
        ''')),
        ("docs/merging.md", dedent('''
            # How files are merged

            Configuration is built from three layers, later layers winning: the built-in defaults,
            `base.yaml`, then `<environment>.yaml`, then environment variables prefixed with `APP_`
            (`APP_DATABASE__POOL_SIZE=20` sets `database.pool_size`).

            * Mappings are merged key by key.
            * Lists are **replaced** as a whole: a list in a later layer is the full list.
            * Scalars are replaced.

            `load_config()` never modifies its inputs and can be called any number of times.
        ''')),
    ],
    trace=dedent("""
        $ python -c 'from layercake.loader import load_config as l; s=l("staging"); p=l("production"); print(p["database"], p["allowed_hosts"])'
        {'host': 'db.prod.internal', 'port': 5432, 'pool_size': 40, 'timeout_s': 5} ['localhost', 'staging.example.com', 'example.com', 'www.example.com']
        $ python -c 'from layercake.loader import load_config as l; p=l("production"); print(p["database"], p["allowed_hosts"])'
        {'host': 'db.prod.internal', 'port': 5432, 'pool_size': 10, 'timeout_s': 5} ['localhost', 'example.com', 'www.example.com']
    """),
    test=("tests/test_loader.py", dedent('''
        from layercake.defaults import DEFAULTS
        from layercake.loader import load_config


        def test_environments_are_independent(tmp_path):
            (tmp_path / "staging.yaml").write_text("database: {pool_size: 40}\\nallowed_hosts: [staging.example.com]\\n")
            (tmp_path / "production.yaml").write_text("database: {host: db.prod.internal}\\nallowed_hosts: [example.com]\\n")
            staging = load_config("staging", tmp_path)
            production = load_config("production", tmp_path)
            assert staging["database"]["pool_size"] == 40
            assert production["database"]["pool_size"] == 10
            assert production["allowed_hosts"] == ["example.com"]
            assert DEFAULTS["database"]["pool_size"] == 10
            assert DEFAULTS["allowed_hosts"] == ["localhost"]
    ''')),
    test_output=dedent("""
        $ python -m pytest -q tests/test_loader.py
        F                                                                        [100%]
        =================================== FAILURES ===================================
        ______________________ test_environments_are_independent _______________________
        >       assert production["database"]["pool_size"] == 10
        E       assert 40 == 10
        tests/test_loader.py:11: AssertionError
        =========================== short test summary info ============================
        FAILED tests/test_loader.py::test_environments_are_independent - assert 40 == 10
        1 failed in 0.05s
    """),
    commits=[
        "aa90d14 env: support double-underscore nesting in APP_ variables",
        "3e6f7b2 loader: optional base.yaml layer",
        "d1c8e55 docs: describe merge semantics",
    ],
)

# ------------------------------------------------------------------------------------------------ Python: path traversal
scenario(
    repo="quillhouse/staticbox",
    lang="Python",
    test_cmd="python -m pytest -q tests/test_resolve.py",
    title="[security] Path check in resolve_path() can be bypassed with a sibling directory prefix",
    issue=dedent("""
        Reported privately, now fixed upstream in our fork; opening here with maintainers' permission.

        `staticbox` serves files from a root directory (say `/srv/site`). `resolve_path()` joins the request
        path to the root, normalises it with `os.path.abspath`, and then checks
        `full.startswith(self.root)`. That string check also accepts `/srv/site-backups/db.sql`, because
        `"/srv/site-backups/db.sql".startswith("/srv/site")` is true. A request for
        `/../site-backups/db.sql` therefore serves a file outside the root, on any deployment where a sibling
        directory shares the root's name as a prefix (very common: `site`, `site-old`, `site-backups`).

        Symlinks are a second, related problem: `abspath` does not resolve them, so a symlink inside the root
        pointing outside it is followed. Some users rely on that (shared `node_modules`), so that part should
        probably be an option (`follow_symlinks=False` by default?), but the prefix bug is a plain
        vulnerability.

        On Windows the same code also compares paths case-sensitively, so `C:\\Site` vs `c:\\site` rejects
        valid files; less important but worth handling if the fix uses `os.path.commonpath` or
        `Path.is_relative_to`.

        Please also make sure `%2e%2e/` is handled: the request path is URL-decoded before `resolve_path()`.
    """),
    tree=dedent("""
        staticbox/
        ├── staticbox/
        │   ├── __init__.py
        │   ├── app.py
        │   ├── files.py
        │   ├── mime.py
        │   └── etag.py
        └── tests/
            ├── conftest.py
            ├── test_app.py
            └── test_resolve.py
    """),
    files=[
        ("staticbox/files.py", dedent('''
            from __future__ import annotations

            import os
            import stat
            from dataclasses import dataclass
            from urllib.parse import unquote

            from .etag import make_etag
            from .mime import guess_type


            class NotFound(Exception):
                pass


            class Forbidden(Exception):
                pass


            @dataclass
            class FileInfo:
                path: str
                size: int
                mtime: float
                content_type: str
                etag: str


            class FileStore:
                def __init__(self, root: str, index_files: tuple[str, ...] = ("index.html",)) -> None:
                    self.root = os.path.abspath(root)
                    self.index_files = index_files

                def resolve_path(self, url_path: str) -> str:
                    """Map a URL path to a file system path inside the root, or raise Forbidden."""
                    relative = unquote(url_path).lstrip("/")
                    full = os.path.abspath(os.path.join(self.root, relative))
                    if not full.startswith(self.root):
                        raise Forbidden(url_path)
                    return full

                def stat(self, url_path: str) -> FileInfo:
                    full = self.resolve_path(url_path)
                    try:
                        info = os.stat(full)
                    except FileNotFoundError:
                        raise NotFound(url_path) from None
                    if stat.S_ISDIR(info.st_mode):
                        for name in self.index_files:
                            candidate = os.path.join(full, name)
                            if os.path.isfile(candidate):
                                full, info = candidate, os.stat(candidate)
                                break
                        else:
                            raise NotFound(url_path)
                    return FileInfo(full, info.st_size, info.st_mtime, guess_type(full), make_etag(info))
        ''')),
        ("staticbox/app.py", dedent('''
            from __future__ import annotations

            from typing import Callable, Iterable

            from .files import FileStore, Forbidden, NotFound

            StartResponse = Callable[[str, list[tuple[str, str]]], None]


            def make_app(root: str, cache_seconds: int = 3600):
                store = FileStore(root)

                def app(environ: dict, start_response: StartResponse) -> Iterable[bytes]:
                    if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
                        start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
                        return [b""]
                    try:
                        info = store.stat(environ.get("PATH_INFO", "/"))
                    except NotFound:
                        start_response("404 Not Found", [("Content-Type", "text/plain")])
                        return [b"not found\\n"]
                    except Forbidden:
                        start_response("403 Forbidden", [("Content-Type", "text/plain")])
                        return [b"forbidden\\n"]
                    if environ.get("HTTP_IF_NONE_MATCH") == info.etag:
                        start_response("304 Not Modified", [("ETag", info.etag)])
                        return [b""]
                    headers = [
                        ("Content-Type", info.content_type),
                        ("Content-Length", str(info.size)),
                        ("ETag", info.etag),
                        ("Cache-Control", f"public, max-age={cache_seconds}"),
                    ]
                    start_response("200 OK", headers)
                    if environ["REQUEST_METHOD"] == "HEAD":
                        return [b""]
                    return open(info.path, "rb")

                return app
        ''')),
    ],
    trace=dedent("""
        $ mkdir -p /tmp/demo/site /tmp/demo/site-backups && echo secret > /tmp/demo/site-backups/db.sql
        $ python -m staticbox --root /tmp/demo/site --port 8080 &
        $ curl -s --path-as-is http://127.0.0.1:8080/../site-backups/db.sql
        secret
        $ curl -s --path-as-is http://127.0.0.1:8080/%2e%2e/site-backups/db.sql
        secret
        $ curl -s --path-as-is http://127.0.0.1:8080/../etc/passwd
        forbidden
    """),
    test=("tests/test_resolve.py", dedent('''
        import os

        import pytest

        from staticbox.files import FileStore, Forbidden


        @pytest.fixture
        def store(tmp_path):
            (tmp_path / "site").mkdir()
            (tmp_path / "site" / "index.html").write_text("hi")
            (tmp_path / "site-backups").mkdir()
            (tmp_path / "site-backups" / "db.sql").write_text("secret")
            return FileStore(str(tmp_path / "site"))


        @pytest.mark.parametrize("path", ["/../site-backups/db.sql", "/%2e%2e/site-backups/db.sql", "/../site-backups"])
        def test_sibling_prefix_is_forbidden(store, path):
            with pytest.raises(Forbidden):
                store.resolve_path(path)


        def test_root_itself_is_allowed(store):
            assert store.resolve_path("/") == store.root


        def test_symlink_out_of_root_is_forbidden_by_default(store, tmp_path):
            os.symlink(tmp_path / "site-backups", tmp_path / "site" / "backups")
            with pytest.raises(Forbidden):
                store.resolve_path("/backups/db.sql")
    ''')),
    test_output=dedent("""
        $ python -m pytest -q tests/test_resolve.py
        FFF.F                                                                    [100%]
        =================================== FAILURES ===================================
        _______________ test_sibling_prefix_is_forbidden[/../site-backups/db.sql] _______________
        E       Failed: DID NOT RAISE <class 'staticbox.files.Forbidden'>
        ____________ test_sibling_prefix_is_forbidden[/%2e%2e/site-backups/db.sql] _____________
        E       Failed: DID NOT RAISE <class 'staticbox.files.Forbidden'>
        _________________ test_sibling_prefix_is_forbidden[/../site-backups] _________________
        E       Failed: DID NOT RAISE <class 'staticbox.files.Forbidden'>
        _________________ test_symlink_out_of_root_is_forbidden_by_default _________________
        E       Failed: DID NOT RAISE <class 'staticbox.files.Forbidden'>
        =========================== short test summary info ============================
        FAILED tests/test_resolve.py::test_sibling_prefix_is_forbidden[/../site-backups/db.sql]
        FAILED tests/test_resolve.py::test_sibling_prefix_is_forbidden[/%2e%2e/site-backups/db.sql]
        FAILED tests/test_resolve.py::test_sibling_prefix_is_forbidden[/../site-backups]
        FAILED tests/test_resolve.py::test_symlink_out_of_root_is_forbidden_by_default
        4 failed, 1 passed in 0.08s
    """),
    commits=[
        "61f0a2c Serve index.html for directories",
        "0b9de71 ETag and If-None-Match support",
        "e5c3a18 Decode percent-escapes in PATH_INFO",
    ],
)

# ------------------------------------------------------------------------------------------------ Go: concurrent map
scenario(
    repo="kestrel-io/vaultkv",
    lang="Go",
    test_cmd="go test -race ./internal/metrics/...",
    title="fatal error: concurrent map writes in metrics.Registry under load",
    issue=dedent("""
        Since upgrading to v0.14.0 our vaultkv nodes crash a few times a day under load with
        `fatal error: concurrent map writes`. It is not a panic we can recover from; the whole process dies and
        the node rejoins the cluster a minute later, which triggers a rebalance.

        The stack always points at `metrics.(*Registry).Counter`, called from the request handlers. v0.14.0 added
        per-tenant counters (`requests_total{tenant="..."}`), so counters are now created lazily on the first
        request of each tenant instead of at start-up, which is probably why it only started now.

        `go test -race` on our integration suite reports the race as well (output below). I think `Counter()`
        and `Gauge()` need a lock, and `Snapshot()` (used by the `/metrics` handler) iterates the same maps.
        Please keep the fast path cheap: `Counter()` is called on every request, and we measured ~2.5M calls per
        second per node. An RWMutex with a read-locked lookup first, or `sync.Map`, would both be fine for us.
    """),
    tree=dedent("""
        vaultkv/
        ├── cmd/vaultkv/main.go
        ├── go.mod
        ├── internal/
        │   ├── metrics/
        │   │   ├── registry.go
        │   │   ├── counter.go
        │   │   ├── registry_test.go
        │   │   └── http.go
        │   ├── server/
        │   │   ├── handlers.go
        │   │   └── server.go
        │   └── store/
        │       ├── store.go
        │       └── wal.go
        └── Makefile
    """),
    files=[
        ("internal/metrics/registry.go", dedent('''
            package metrics

            import (
            	"sort"
            	"strings"
            )

            // Registry holds named counters and gauges. Metrics are created on first use.
            type Registry struct {
            	counters map[string]*Counter
            	gauges   map[string]*Gauge
            }

            func NewRegistry() *Registry {
            	return &Registry{
            		counters: make(map[string]*Counter),
            		gauges:   make(map[string]*Gauge),
            	}
            }

            func key(name string, labels map[string]string) string {
            	if len(labels) == 0 {
            		return name
            	}
            	parts := make([]string, 0, len(labels))
            	for k, v := range labels {
            		parts = append(parts, k+"=\\""+v+"\\"")
            	}
            	sort.Strings(parts)
            	return name + "{" + strings.Join(parts, ",") + "}"
            }

            // Counter returns the counter for name and labels, creating it if needed.
            func (r *Registry) Counter(name string, labels map[string]string) *Counter {
            	k := key(name, labels)
            	c, ok := r.counters[k]
            	if !ok {
            		c = &Counter{}
            		r.counters[k] = c
            	}
            	return c
            }

            // Gauge returns the gauge for name and labels, creating it if needed.
            func (r *Registry) Gauge(name string, labels map[string]string) *Gauge {
            	k := key(name, labels)
            	g, ok := r.gauges[k]
            	if !ok {
            		g = &Gauge{}
            		r.gauges[k] = g
            	}
            	return g
            }

            // Snapshot returns the current value of every metric, keyed by its full name.
            func (r *Registry) Snapshot() map[string]float64 {
            	out := make(map[string]float64, len(r.counters)+len(r.gauges))
            	for k, c := range r.counters {
            		out[k] = float64(c.Value())
            	}
            	for k, g := range r.gauges {
            		out[k] = g.Value()
            	}
            	return out
            }
        ''')),
        ("internal/metrics/counter.go", dedent('''
            package metrics

            import (
            	"math"
            	"sync/atomic"
            )

            type Counter struct{ v atomic.Uint64 }

            func (c *Counter) Inc()           { c.v.Add(1) }
            func (c *Counter) Add(n uint64)   { c.v.Add(n) }
            func (c *Counter) Value() uint64  { return c.v.Load() }

            type Gauge struct{ bits atomic.Uint64 }

            func (g *Gauge) Set(v float64)   { g.bits.Store(math.Float64bits(v)) }
            func (g *Gauge) Value() float64  { return math.Float64frombits(g.bits.Load()) }
        ''')),
        ("internal/server/handlers.go", dedent('''
            package server

            import (
            	"errors"
            	"net/http"
            	"time"

            	"github.com/kestrel-io/vaultkv/internal/metrics"
            	"github.com/kestrel-io/vaultkv/internal/store"
            )

            type Handlers struct {
            	store   *store.Store
            	metrics *metrics.Registry
            }

            func (h *Handlers) Get(w http.ResponseWriter, r *http.Request) {
            	start := time.Now()
            	tenant := r.Header.Get("X-Tenant")
            	h.metrics.Counter("requests_total", map[string]string{"tenant": tenant, "op": "get"}).Inc()
            	value, err := h.store.Get(r.Context(), tenant, r.PathValue("key"))
            	switch {
            	case errors.Is(err, store.ErrNotFound):
            		http.Error(w, "not found", http.StatusNotFound)
            	case err != nil:
            		h.metrics.Counter("errors_total", map[string]string{"tenant": tenant, "op": "get"}).Inc()
            		http.Error(w, err.Error(), http.StatusInternalServerError)
            	default:
            		w.Header().Set("Content-Type", "application/octet-stream")
            		_, _ = w.Write(value)
            	}
            	h.metrics.Gauge("last_request_seconds", map[string]string{"op": "get"}).Set(time.Since(start).Seconds())
            }
        ''')),
    ],
    trace=dedent("""
        fatal error: concurrent map writes

        goroutine 48211 [running]:
        github.com/kestrel-io/vaultkv/internal/metrics.(*Registry).Counter(0xc0001a2f00, {0xb1c2e5, 0xe}, 0xc01a7e3c80)
        	/src/internal/metrics/registry.go:42 +0x1a5
        github.com/kestrel-io/vaultkv/internal/server.(*Handlers).Get(0xc0001c4120, {0xc8f0a0, 0xc02b11e0e0}, 0xc01f6d2240)
        	/src/internal/server/handlers.go:19 +0x10b
        net/http.HandlerFunc.ServeHTTP(...)
        	/usr/local/go/src/net/http/server.go:2171
        net/http.(*ServeMux).ServeHTTP(0xc000124d80, {0xc8f0a0, 0xc02b11e0e0}, 0xc01f6d2240)
        	/usr/local/go/src/net/http/server.go:2688 +0x1ad
        net/http.serverHandler.ServeHTTP({0xc0001ae0f0}, {0xc8f0a0, 0xc02b11e0e0}, 0xc01f6d2240)
        	/usr/local/go/src/net/http/server.go:3142 +0x8e
        net/http.(*conn).serve(0xc02a0d8a20, {0xc90828, 0xc0003f5e90})
        	/usr/local/go/src/net/http/server.go:2044 +0x5e8
        created by net/http.(*Server).Serve in goroutine 1
        	/usr/local/go/src/net/http/server.go:3290 +0x4b4

        goroutine 48207 [runnable]:
        github.com/kestrel-io/vaultkv/internal/metrics.(*Registry).Counter(0xc0001a2f00, {0xb1c2e5, 0xe}, 0xc01a8f1a40)
        	/src/internal/metrics/registry.go:39 +0x7e
        github.com/kestrel-io/vaultkv/internal/server.(*Handlers).Get(0xc0001c4120, {0xc8f0a0, 0xc02b0f6000}, 0xc01f5e8120)
        	/src/internal/server/handlers.go:19 +0x10b
    """),
    test=("internal/metrics/registry_test.go", dedent('''
        package metrics

        import (
        	"fmt"
        	"sync"
        	"testing"
        )

        func TestConcurrentCounterCreation(t *testing.T) {
        	r := NewRegistry()
        	var wg sync.WaitGroup
        	for g := 0; g < 16; g++ {
        		wg.Add(1)
        		go func(g int) {
        			defer wg.Done()
        			for i := 0; i < 1000; i++ {
        				r.Counter("requests_total", map[string]string{"tenant": fmt.Sprint(i % 50)}).Inc()
        				if i%100 == 0 {
        					_ = r.Snapshot()
        				}
        			}
        		}(g)
        	}
        	wg.Wait()
        	var total float64
        	for _, v := range r.Snapshot() {
        		total += v
        	}
        	if total != 16000 {
        		t.Fatalf("total = %v, want 16000", total)
        	}
        }

        func BenchmarkCounterHit(b *testing.B) {
        	r := NewRegistry()
        	labels := map[string]string{"tenant": "t1", "op": "get"}
        	b.RunParallel(func(pb *testing.PB) {
        		for pb.Next() {
        			r.Counter("requests_total", labels).Inc()
        		}
        	})
        }
    ''')),
    test_output=dedent("""
        $ go test -race ./internal/metrics/...
        ==================
        WARNING: DATA RACE
        Write at 0x00c0000b4060 by goroutine 9:
          runtime.mapassign_faststr()
              /usr/local/go/src/runtime/map_faststr.go:223 +0x0
          github.com/kestrel-io/vaultkv/internal/metrics.(*Registry).Counter()
              /src/internal/metrics/registry.go:42 +0x1c4
          github.com/kestrel-io/vaultkv/internal/metrics.TestConcurrentCounterCreation.func1()
              /src/internal/metrics/registry_test.go:17 +0x13d

        Previous read at 0x00c0000b4060 by goroutine 12:
          runtime.mapaccess2_faststr()
              /usr/local/go/src/runtime/map_faststr.go:117 +0x0
          github.com/kestrel-io/vaultkv/internal/metrics.(*Registry).Counter()
              /src/internal/metrics/registry.go:39 +0x96
        ==================
        --- FAIL: TestConcurrentCounterCreation (0.04s)
            testing.go:1398: race detected during execution of test
        FAIL
        FAIL	github.com/kestrel-io/vaultkv/internal/metrics	0.081s
        FAIL
    """),
    commits=[
        "4a7d0e3 server: per-tenant request and error counters",
        "bd21c9f metrics: lazily create counters on first use",
        "8e3f510 store: fsync WAL segments in batches",
    ],
)

# ------------------------------------------------------------------------------------------------ Go: backoff overflow
scenario(
    repo="relaymesh/retryhttp",
    lang="Go",
    test_cmd="go test ./...",
    title="Backoff becomes negative after ~35 attempts, client hammers the server",
    issue=dedent("""
        We use `retryhttp.Client` with `MaxAttempts: 0` (retry forever) for a webhook delivery worker. When the
        receiving service was down for two hours last night, our worker went from one request every 30s (the
        `MaxDelay`) to thousands of requests per second after a while, and the receiving team's WAF banned our
        IPs.

        I reproduced it locally: `Backoff.Delay(attempt)` computes `Base * (1 << attempt)`; from attempt 35 on
        (with `Base = 500ms`) the multiplication overflows `time.Duration` (int64 nanoseconds), the result is
        often negative, the `min(delay, MaxDelay)` clamp keeps the negative value, and the timer fires
        immediately for negative durations. From attempt 56 on the shift itself overflows and the delay is 0.
        Jitter makes it worse since `rand.Int63n` panics on a non-positive argument in one code path (we saw
        `panic: invalid argument to Int63n` once).

        Expected: the delay saturates at `MaxDelay` for any attempt number, jitter stays within
        `[delay/2, delay]` ("equal jitter", as the docs say), and no arithmetic can overflow.

        retryhttp v1.8.2, go 1.22.4, linux/amd64.
    """),
    tree=dedent("""
        retryhttp/
        ├── backoff.go
        ├── backoff_test.go
        ├── client.go
        ├── client_test.go
        ├── doc.go
        ├── go.mod
        └── policy.go
    """),
    files=[
        ("backoff.go", dedent('''
            package retryhttp

            import (
            	"math/rand"
            	"sync"
            	"time"
            )

            // Backoff computes exponential delays with "equal jitter": the delay for attempt n is
            // d = min(Base * 2^n, MaxDelay), and the actual sleep is uniformly distributed in [d/2, d].
            type Backoff struct {
            	Base     time.Duration
            	MaxDelay time.Duration
            	Jitter   bool

            	mu  sync.Mutex
            	rng *rand.Rand
            }

            func NewBackoff(base, maxDelay time.Duration, jitter bool) *Backoff {
            	return &Backoff{
            		Base:     base,
            		MaxDelay: maxDelay,
            		Jitter:   jitter,
            		rng:      rand.New(rand.NewSource(time.Now().UnixNano())),
            	}
            }

            // Delay returns how long to wait before attempt number attempt (0-based).
            func (b *Backoff) Delay(attempt int) time.Duration {
            	d := b.Base * time.Duration(1<<uint(attempt))
            	if d > b.MaxDelay {
            		d = b.MaxDelay
            	}
            	if !b.Jitter {
            		return d
            	}
            	half := d / 2
            	b.mu.Lock()
            	defer b.mu.Unlock()
            	return half + time.Duration(b.rng.Int63n(int64(half)+1))
            }
        ''')),
        ("client.go", dedent('''
            package retryhttp

            import (
            	"context"
            	"errors"
            	"fmt"
            	"io"
            	"net/http"
            	"time"
            )

            type Client struct {
            	HTTP        *http.Client
            	Backoff     *Backoff
            	MaxAttempts int // 0 means retry forever
            	Policy      Policy
            }

            var ErrGiveUp = errors.New("retryhttp: giving up")

            // Do sends the request, retrying according to the policy. The request body, if any, must be
            // re-readable: set req.GetBody.
            func (c *Client) Do(ctx context.Context, req *http.Request) (*http.Response, error) {
            	for attempt := 0; ; attempt++ {
            		if attempt > 0 && req.GetBody != nil {
            			body, err := req.GetBody()
            			if err != nil {
            				return nil, fmt.Errorf("retryhttp: rewinding body: %w", err)
            			}
            			req.Body = body
            		}
            		resp, err := c.HTTP.Do(req.WithContext(ctx))
            		retry, wait := c.Policy.ShouldRetry(resp, err)
            		if !retry {
            			return resp, err
            		}
            		if resp != nil {
            			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
            			resp.Body.Close()
            		}
            		if c.MaxAttempts > 0 && attempt+1 >= c.MaxAttempts {
            			return nil, fmt.Errorf("%w after %d attempts: %v", ErrGiveUp, attempt+1, err)
            		}
            		if wait <= 0 {
            			wait = c.Backoff.Delay(attempt)
            		}
            		timer := time.NewTimer(wait)
            		select {
            		case <-ctx.Done():
            			timer.Stop()
            			return nil, ctx.Err()
            		case <-timer.C:
            		}
            	}
            }
        ''')),
        ("policy.go", dedent('''
            package retryhttp

            import (
            	"net/http"
            	"strconv"
            	"time"
            )

            // Policy decides whether a response or error is retried, and may ask for a specific wait
            // (from a Retry-After header); a zero wait means "use the backoff".
            type Policy interface {
            	ShouldRetry(resp *http.Response, err error) (bool, time.Duration)
            }

            type DefaultPolicy struct{}

            func (DefaultPolicy) ShouldRetry(resp *http.Response, err error) (bool, time.Duration) {
            	if err != nil {
            		return true, 0
            	}
            	switch resp.StatusCode {
            	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
            		if s, convErr := strconv.Atoi(resp.Header.Get("Retry-After")); convErr == nil && s > 0 {
            			return true, time.Duration(s) * time.Second
            		}
            		return true, 0
            	case http.StatusBadGateway, http.StatusGatewayTimeout:
            		return true, 0
            	}
            	return false, 0
            }
        ''')),
    ],
    trace=dedent("""
        $ go run ./examples/backoff-table -base 500ms -max 30s -attempts 70
        attempt  delay
        0        500ms
        1        1s
        ...
        5        16s
        6        30s
        ...
        34       30s
        35       -351909h41m29.709551616s
        36       -703819h22m59.419103232s
        37       -1407638h45m58.838206464s
        38       30s
        39       -506459h29m21.64327424s
        ...
        55       -2562047h47m16.854775808s
        56       0s
        57       0s
        ...
        69       0s

        with -jitter:
        panic: invalid argument to Int63n

        goroutine 1 [running]:
        math/rand.(*Rand).Int63n(0xc000012030?, 0xc000112000?)
        	/usr/local/go/src/math/rand/rand.go:121 +0xd0
        github.com/relaymesh/retryhttp.(*Backoff).Delay(0xc0000a4000, 0x23)
        	/src/backoff.go:41 +0xf1
        main.main()
        	/src/examples/backoff-table/main.go:27 +0x1e5
        exit status 2
    """),
    test=("backoff_test.go", dedent('''
        package retryhttp

        import (
        	"testing"
        	"time"
        )

        func TestDelaySaturates(t *testing.T) {
        	b := NewBackoff(500*time.Millisecond, 30*time.Second, false)
        	for attempt := 0; attempt < 200; attempt++ {
        		d := b.Delay(attempt)
        		if d <= 0 || d > 30*time.Second {
        			t.Fatalf("attempt %d: delay %v out of range", attempt, d)
        		}
        	}
        	if got := b.Delay(100); got != 30*time.Second {
        		t.Fatalf("Delay(100) = %v, want 30s", got)
        	}
        }

        func TestJitterRange(t *testing.T) {
        	b := NewBackoff(time.Second, time.Minute, true)
        	for attempt := 0; attempt < 200; attempt++ {
        		full := NewBackoff(time.Second, time.Minute, false).Delay(attempt)
        		d := b.Delay(attempt)
        		if d < full/2 || d > full {
        			t.Fatalf("attempt %d: %v not in [%v, %v]", attempt, d, full/2, full)
        		}
        	}
        }
    ''')),
    test_output=dedent("""
        $ go test ./...
        --- FAIL: TestDelaySaturates (0.00s)
            backoff_test.go:12: attempt 35: delay -351909h41m29.709551616s out of range
        --- FAIL: TestJitterRange (0.00s)
        panic: invalid argument to Int63n [recovered]
        	panic: invalid argument to Int63n

        goroutine 7 [running]:
        testing.tRunner.func1.2({0x5a1e20, 0x62f7d0})
        	/usr/local/go/src/testing/testing.go:1631 +0x24a
        math/rand.(*Rand).Int63n(0xc0000142a0, 0xc0000b2000)
        	/usr/local/go/src/math/rand/rand.go:121 +0xd0
        github.com/relaymesh/retryhttp.(*Backoff).Delay(0xc0000a6080, 0x22)
        	/src/backoff.go:41 +0xf1
        github.com/relaymesh/retryhttp.TestJitterRange(0xc000003a00)
        	/src/backoff_test.go:22 +0x11c
        FAIL	github.com/relaymesh/retryhttp	0.006s
        FAIL
    """),
    commits=[
        "0fa3e21 Honour Retry-After seconds in DefaultPolicy",
        "c7b8812 Allow MaxAttempts = 0 to retry forever",
        "19d4e6a Equal-jitter backoff",
    ],
)

# ------------------------------------------------------------------------------------------------ Go: error wrapping
scenario(
    repo="tallgrass/objstore",
    lang="Go",
    test_cmd="go test ./pkg/objstore/...",
    title="errors.Is(err, objstore.ErrNotFound) is false for missing objects on the S3 backend",
    issue=dedent("""
        Our cache layer does:

        ```go
        data, err := store.Get(ctx, key)
        if errors.Is(err, objstore.ErrNotFound) {
            return fetchFromOrigin(ctx, key)
        }
        ```

        This works with the `fs` and `memory` backends, but with the `s3` backend every cache miss is reported
        as an internal error (HTTP 500 in our service) instead of falling through to the origin. The error
        message looks right: `objstore: get "thumbnails/ab/12.webp": object not found`.

        Looking at `s3.go`, the backend maps a `NoSuchKey` API error to `fmt.Errorf("objstore: get %q: %v",
        key, ErrNotFound)`. `%v` formats the sentinel into the message but does not wrap it, so `errors.Is` cannot
        find it. The `Stat` and `Delete` paths have the same pattern, and `retry.go` wraps errors with `%v` as
        well, so even the fs backend loses the sentinel when a retry happens.

        Expected: every backend returns errors that satisfy `errors.Is(err, ErrNotFound)` for missing keys,
        `errors.Is(err, context.Canceled)` when the context is cancelled, and `errors.As(err, &*smithy.
        GenericAPIError)`-style unwrapping still reaches the original S3 error for anything else.
    """),
    tree=dedent("""
        objstore/
        ├── go.mod
        ├── pkg/objstore/
        │   ├── objstore.go
        │   ├── errors.go
        │   ├── fs.go
        │   ├── memory.go
        │   ├── retry.go
        │   ├── s3.go
        │   ├── s3_test.go
        │   └── conformance_test.go
        └── internal/fakes3/
            └── server.go
    """),
    files=[
        ("pkg/objstore/errors.go", dedent('''
            package objstore

            import "errors"

            var (
            	// ErrNotFound is returned (possibly wrapped) when an object does not exist.
            	ErrNotFound = errors.New("object not found")
            	// ErrPreconditionFailed is returned when an If-Match / If-None-Match condition fails.
            	ErrPreconditionFailed = errors.New("precondition failed")
            )
        ''')),
        ("pkg/objstore/s3.go", dedent('''
            package objstore

            import (
            	"bytes"
            	"context"
            	"errors"
            	"fmt"
            	"io"

            	"github.com/aws/aws-sdk-go-v2/aws"
            	"github.com/aws/aws-sdk-go-v2/service/s3"
            	"github.com/aws/aws-sdk-go-v2/service/s3/types"
            )

            type S3Store struct {
            	client *s3.Client
            	bucket string
            	prefix string
            }

            func (s *S3Store) path(key string) string { return s.prefix + key }

            func (s *S3Store) Get(ctx context.Context, key string) ([]byte, error) {
            	out, err := s.client.GetObject(ctx, &s3.GetObjectInput{
            		Bucket: aws.String(s.bucket),
            		Key:    aws.String(s.path(key)),
            	})
            	if err != nil {
            		var nsk *types.NoSuchKey
            		if errors.As(err, &nsk) {
            			return nil, fmt.Errorf("objstore: get %q: %v", key, ErrNotFound)
            		}
            		return nil, fmt.Errorf("objstore: get %q: %v", key, err)
            	}
            	defer out.Body.Close()
            	return io.ReadAll(out.Body)
            }

            func (s *S3Store) Put(ctx context.Context, key string, data []byte) error {
            	_, err := s.client.PutObject(ctx, &s3.PutObjectInput{
            		Bucket: aws.String(s.bucket),
            		Key:    aws.String(s.path(key)),
            		Body:   bytes.NewReader(data),
            	})
            	if err != nil {
            		return fmt.Errorf("objstore: put %q: %v", key, err)
            	}
            	return nil
            }

            func (s *S3Store) Stat(ctx context.Context, key string) (Info, error) {
            	out, err := s.client.HeadObject(ctx, &s3.HeadObjectInput{
            		Bucket: aws.String(s.bucket),
            		Key:    aws.String(s.path(key)),
            	})
            	if err != nil {
            		var nf *types.NotFound
            		if errors.As(err, &nf) {
            			return Info{}, fmt.Errorf("objstore: stat %q: %v", key, ErrNotFound)
            		}
            		return Info{}, fmt.Errorf("objstore: stat %q: %v", key, err)
            	}
            	return Info{Key: key, Size: aws.ToInt64(out.ContentLength), ETag: aws.ToString(out.ETag)}, nil
            }
        ''')),
        ("pkg/objstore/retry.go", dedent('''
            package objstore

            import (
            	"context"
            	"fmt"
            	"time"
            )

            // withRetry runs op up to attempts times while it returns a retryable error.
            func withRetry(ctx context.Context, attempts int, op func() error) error {
            	var err error
            	delay := 50 * time.Millisecond
            	for i := 0; i < attempts; i++ {
            		if err = op(); err == nil || !retryable(err) {
            			return err
            		}
            		select {
            		case <-ctx.Done():
            			return fmt.Errorf("objstore: retry aborted: %v (last error: %v)", ctx.Err(), err)
            		case <-time.After(delay):
            		}
            		delay *= 2
            	}
            	return fmt.Errorf("objstore: %d attempts failed: %v", attempts, err)
            }
        ''')),
    ],
    trace=dedent("""
        $ go run ./cmd/objcat -backend s3 -bucket thumbs-dev thumbnails/ab/12.webp
        error: objstore: get "thumbnails/ab/12.webp": object not found
        errors.Is(err, objstore.ErrNotFound) = false
        errors.Unwrap(err) = <nil>
        fmt.Sprintf("%T", err) = *errors.errorString   (fs backend: *fmt.wrapError)
    """),
    test=("pkg/objstore/conformance_test.go", dedent('''
        package objstore

        import (
        	"context"
        	"errors"
        	"testing"
        )

        func runConformance(t *testing.T, newStore func(t *testing.T) Store) {
        	ctx := context.Background()

        	t.Run("GetMissing", func(t *testing.T) {
        		_, err := newStore(t).Get(ctx, "does/not/exist")
        		if !errors.Is(err, ErrNotFound) {
        			t.Fatalf("Get missing: err = %v, want ErrNotFound", err)
        		}
        	})

        	t.Run("StatMissing", func(t *testing.T) {
        		_, err := newStore(t).Stat(ctx, "does/not/exist")
        		if !errors.Is(err, ErrNotFound) {
        			t.Fatalf("Stat missing: err = %v, want ErrNotFound", err)
        		}
        	})

        	t.Run("Cancelled", func(t *testing.T) {
        		cctx, cancel := context.WithCancel(ctx)
        		cancel()
        		_, err := newStore(t).Get(cctx, "a")
        		if !errors.Is(err, context.Canceled) {
        			t.Fatalf("Get with cancelled ctx: err = %v, want context.Canceled", err)
        		}
        	})
        }

        func TestConformanceMemory(t *testing.T) { runConformance(t, newMemoryForTest) }
        func TestConformanceFS(t *testing.T)     { runConformance(t, newFSForTest) }
        func TestConformanceS3(t *testing.T)     { runConformance(t, newFakeS3ForTest) }
    ''')),
    test_output=dedent("""
        $ go test ./pkg/objstore/...
        --- FAIL: TestConformanceS3 (0.03s)
            --- FAIL: TestConformanceS3/GetMissing (0.01s)
                conformance_test.go:15: Get missing: err = objstore: get "does/not/exist": object not found, want ErrNotFound
            --- FAIL: TestConformanceS3/StatMissing (0.01s)
                conformance_test.go:22: Stat missing: err = objstore: stat "does/not/exist": object not found, want ErrNotFound
            --- FAIL: TestConformanceS3/Cancelled (0.00s)
                conformance_test.go:31: Get with cancelled ctx: err = objstore: get "a": operation error S3: GetObject, context canceled, want context.Canceled
        FAIL
        FAIL	github.com/tallgrass/objstore/pkg/objstore	0.118s
        FAIL
    """),
    commits=[
        "f2a81c7 s3: map NotFound on HeadObject to ErrNotFound",
        "9b0e4d2 Add conformance tests run against every backend",
        "35c1fa0 fakes3: minimal in-process S3 for tests",
    ],
)

# ------------------------------------------------------------------------------------------------ Go: nil TLS
scenario(
    repo="openkite/gatewayd",
    lang="Go",
    test_cmd="go test ./internal/upstream/...",
    title="panic: nil pointer dereference when an upstream has no tls block",
    issue=dedent("""
        After upgrading from 2.6 to 2.7, gatewayd crashes on start-up with our existing config. The crash
        happens while building the upstream pool, for an upstream that uses plain HTTP and therefore has no
        `tls:` block:

        ```yaml
        upstreams:
          - name: billing
            url: http://billing.internal:8080
            timeout: 5s
          - name: search
            url: https://search.internal
            tls:
              ca_file: /etc/gatewayd/ca.pem
              server_name: search.internal
        ```

        The 2.7 changelog mentions "upstream TLS: support client certificates (mTLS)". I suspect the new code
        reads `u.TLS.CertFile` without checking whether `u.TLS` is nil. Adding an empty `tls: {}` to the billing
        upstream works around the crash, but then gatewayd tries to speak TLS to a plain HTTP port... actually no,
        it still uses http because of the URL scheme, so the workaround is OK for now.

        Expected: upstreams without `tls` work as in 2.6; `tls` on an `http://` upstream should probably be a
        config validation error rather than silently ignored. Please also check `Reload()`, which builds the
        pool through the same function.
    """),
    tree=dedent("""
        gatewayd/
        ├── cmd/gatewayd/main.go
        ├── go.mod
        ├── internal/
        │   ├── config/
        │   │   ├── config.go
        │   │   └── validate.go
        │   ├── proxy/
        │   │   └── proxy.go
        │   └── upstream/
        │       ├── pool.go
        │       ├── tls.go
        │       └── pool_test.go
        └── CHANGELOG.md
    """),
    files=[
        ("internal/config/config.go", dedent('''
            package config

            import "time"

            type Config struct {
            	Listen    string     `yaml:"listen"`
            	Upstreams []Upstream `yaml:"upstreams"`
            	Routes    []Route    `yaml:"routes"`
            }

            type Upstream struct {
            	Name     string        `yaml:"name"`
            	URL      string        `yaml:"url"`
            	Timeout  time.Duration `yaml:"timeout"`
            	MaxConns int           `yaml:"max_conns"`
            	TLS      *TLS          `yaml:"tls"`
            }

            type TLS struct {
            	CAFile             string `yaml:"ca_file"`
            	CertFile           string `yaml:"cert_file"`
            	KeyFile            string `yaml:"key_file"`
            	ServerName         string `yaml:"server_name"`
            	InsecureSkipVerify bool   `yaml:"insecure_skip_verify"`
            }

            type Route struct {
            	PathPrefix string `yaml:"path_prefix"`
            	Upstream   string `yaml:"upstream"`
            	StripPrefix bool  `yaml:"strip_prefix"`
            }
        ''')),
        ("internal/upstream/tls.go", dedent('''
            package upstream

            import (
            	"crypto/tls"
            	"crypto/x509"
            	"fmt"
            	"os"

            	"github.com/openkite/gatewayd/internal/config"
            )

            func buildTLSConfig(c *config.TLS) (*tls.Config, error) {
            	cfg := &tls.Config{
            		ServerName:         c.ServerName,
            		InsecureSkipVerify: c.InsecureSkipVerify, //nolint:gosec // opt-in for test environments
            		MinVersion:         tls.VersionTLS12,
            	}
            	if c.CAFile != "" {
            		pem, err := os.ReadFile(c.CAFile)
            		if err != nil {
            			return nil, fmt.Errorf("reading ca_file: %w", err)
            		}
            		pool := x509.NewCertPool()
            		if !pool.AppendCertsFromPEM(pem) {
            			return nil, fmt.Errorf("ca_file %s: no certificates found", c.CAFile)
            		}
            		cfg.RootCAs = pool
            	}
            	if c.CertFile != "" || c.KeyFile != "" {
            		cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
            		if err != nil {
            			return nil, fmt.Errorf("loading client certificate: %w", err)
            		}
            		cfg.Certificates = []tls.Certificate{cert}
            	}
            	return cfg, nil
            }
        ''')),
        ("internal/upstream/pool.go", dedent('''
            package upstream

            import (
            	"fmt"
            	"net"
            	"net/http"
            	"net/url"
            	"time"

            	"github.com/openkite/gatewayd/internal/config"
            )

            type Upstream struct {
            	Name      string
            	Target    *url.URL
            	Transport *http.Transport
            	Timeout   time.Duration
            }

            type Pool map[string]*Upstream

            func NewPool(ups []config.Upstream) (Pool, error) {
            	pool := make(Pool, len(ups))
            	for _, u := range ups {
            		built, err := build(u)
            		if err != nil {
            			return nil, fmt.Errorf("upstream %q: %w", u.Name, err)
            		}
            		pool[u.Name] = built
            	}
            	return pool, nil
            }

            func build(u config.Upstream) (*Upstream, error) {
            	target, err := url.Parse(u.URL)
            	if err != nil {
            		return nil, fmt.Errorf("invalid url: %w", err)
            	}
            	transport := &http.Transport{
            		Proxy:               http.ProxyFromEnvironment,
            		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
            		MaxConnsPerHost:     u.MaxConns,
            		IdleConnTimeout:     90 * time.Second,
            		TLSHandshakeTimeout: 10 * time.Second,
            	}
            	// mTLS support (2.7): load the client certificate when one is configured.
            	if u.TLS.CertFile != "" || target.Scheme == "https" {
            		tlsConfig, err := buildTLSConfig(u.TLS)
            		if err != nil {
            			return nil, err
            		}
            		transport.TLSClientConfig = tlsConfig
            	}
            	timeout := u.Timeout
            	if timeout == 0 {
            		timeout = 30 * time.Second
            	}
            	return &Upstream{Name: u.Name, Target: target, Transport: transport, Timeout: timeout}, nil
            }
        ''')),
    ],
    trace=dedent("""
        $ gatewayd -config /etc/gatewayd/gatewayd.yaml
        2024/06/02 09:14:11 gatewayd 2.7.0 starting (go1.22.3 linux/amd64)
        2024/06/02 09:14:11 loaded 2 upstreams, 7 routes
        panic: runtime error: invalid memory address or nil pointer dereference
        [signal SIGSEGV: segmentation violation code=0x1 addr=0x10 pc=0x8e4f2a]

        goroutine 1 [running]:
        github.com/openkite/gatewayd/internal/upstream.build({{0xc0000b6030, 0x7}, {0xc0000b6040, 0x1c}, 0x12a05f200, 0x0, 0x0})
        	/build/internal/upstream/pool.go:46 +0x18a
        github.com/openkite/gatewayd/internal/upstream.NewPool({0xc0000d8000, 0x2, 0x2?})
        	/build/internal/upstream/pool.go:24 +0xd1
        main.run({0x7ffd6f0f3e52, 0x1a})
        	/build/cmd/gatewayd/main.go:58 +0x2f6
        main.main()
        	/build/cmd/gatewayd/main.go:31 +0x1c5
    """),
    test=("internal/upstream/pool_test.go", dedent('''
        package upstream

        import (
        	"testing"

        	"github.com/openkite/gatewayd/internal/config"
        )

        func TestPlainHTTPUpstreamWithoutTLSBlock(t *testing.T) {
        	pool, err := NewPool([]config.Upstream{{Name: "billing", URL: "http://billing.internal:8080"}})
        	if err != nil {
        		t.Fatal(err)
        	}
        	if pool["billing"].Transport.TLSClientConfig != nil {
        		t.Fatal("plain http upstream should not get a TLS config")
        	}
        }

        func TestHTTPSUpstreamWithoutTLSBlockUsesSystemRoots(t *testing.T) {
        	pool, err := NewPool([]config.Upstream{{Name: "api", URL: "https://api.example.com"}})
        	if err != nil {
        		t.Fatal(err)
        	}
        	if cfg := pool["api"].Transport.TLSClientConfig; cfg != nil && cfg.RootCAs != nil {
        		t.Fatal("expected system roots")
        	}
        }
    ''')),
    test_output=dedent("""
        $ go test ./internal/upstream/...
        --- FAIL: TestPlainHTTPUpstreamWithoutTLSBlock (0.00s)
        panic: runtime error: invalid memory address or nil pointer dereference [recovered]
        	panic: runtime error: invalid memory address or nil pointer dereference
        [signal SIGSEGV: segmentation violation code=0x1 addr=0x10 pc=0x6b2d4a]

        goroutine 6 [running]:
        testing.tRunner.func1.2({0x6f3c40, 0x9a1f30})
        	/usr/local/go/src/testing/testing.go:1631 +0x24a
        panic({0x6f3c40?, 0x9a1f30?})
        	/usr/local/go/src/runtime/panic.go:785 +0x132
        github.com/openkite/gatewayd/internal/upstream.build({{0x7b5e31, 0x7}, {0x7b8a52, 0x1c}, 0x0, 0x0, 0x0})
        	/src/internal/upstream/pool.go:46 +0x18a
        github.com/openkite/gatewayd/internal/upstream.NewPool(...)
        	/src/internal/upstream/pool.go:24
        github.com/openkite/gatewayd/internal/upstream.TestPlainHTTPUpstreamWithoutTLSBlock(0xc000007860)
        	/src/internal/upstream/pool_test.go:10 +0x85
        FAIL	github.com/openkite/gatewayd/internal/upstream	0.012s
        FAIL
    """),
    commits=[
        "a3e0c19 Release 2.7.0",
        "7dd2b84 upstream: client certificates for mTLS upstreams",
        "2fc91e6 config: max_conns per upstream",
    ],
)

# ------------------------------------------------------------------------------------------------ Go: goroutine leak
scenario(
    repo="streamforge/batcher",
    lang="Go",
    test_cmd="go test -run TestBatcher -count=1 ./...",
    title="Batcher leaks goroutines (and blocks Close) when the context is cancelled",
    issue=dedent("""
        We create one `batcher.Batcher` per Kafka partition assignment and cancel its context on rebalance.
        After a day of rebalances the consumer has ~40k goroutines (pprof below) and memory keeps growing.
        Most of them are parked in `(*Batcher).flushLoop` on `b.out <- batch`, and some in `Add`.

        What happens, as far as I can tell:

        1. The consumer stops reading `Out()` when its context is cancelled.
        2. `flushLoop` is blocked sending the next batch on `b.out` and never observes `ctx.Done()`, because the
           send is not in a `select` with the context.
        3. `Close()` waits on `b.done`, which `flushLoop` only closes when it returns, so `Close()` blocks too
           (we call it from the rebalance callback, which then blocks the whole consumer group session).

        Expected: after the context is cancelled, `Add` returns `ctx.Err()` promptly, the flush goroutine exits
        (dropping or, ideally, handing back the pending items), and `Close` returns. We are fine with a
        `Pending()` method that returns the items that were not delivered.

        ```
        goroutine profile: total 41873
        39012 @ 0x43e1ce 0x40a7e5 0x40a39b 0x7f1e25 0x471d21
        #	0x7f1e24	github.com/streamforge/batcher.(*Batcher[...]).flushLoop+0x1c4	/src/batcher.go:71
        2810 @ 0x43e1ce 0x40a7e5 0x40a39b 0x7f1a0b 0x7f9c33 0x471d21
        #	0x7f1a0a	github.com/streamforge/batcher.(*Batcher[...]).Add+0x6a	/src/batcher.go:47
        ```
    """),
    tree=dedent("""
        batcher/
        ├── batcher.go
        ├── batcher_test.go
        ├── example_test.go
        ├── go.mod
        └── go.sum
    """),
    files=[
        ("batcher.go", dedent('''
            // Package batcher groups items into batches by size or time.
            package batcher

            import (
            	"context"
            	"time"
            )

            type Batcher[T any] struct {
            	in       chan T
            	out      chan []T
            	done     chan struct{}
            	maxSize  int
            	maxDelay time.Duration
            }

            // New starts a batcher. Batches are emitted on Out() when they reach maxSize items or when
            // maxDelay has passed since the first item of the batch, whichever comes first.
            func New[T any](ctx context.Context, maxSize int, maxDelay time.Duration) *Batcher[T] {
            	b := &Batcher[T]{
            		in:       make(chan T),
            		out:      make(chan []T),
            		done:     make(chan struct{}),
            		maxSize:  maxSize,
            		maxDelay: maxDelay,
            	}
            	go b.flushLoop(ctx)
            	return b
            }

            // Out returns the channel batches are delivered on. It is closed when the batcher stops.
            func (b *Batcher[T]) Out() <-chan []T { return b.out }

            // Add queues an item. It blocks while a full batch is waiting to be delivered.
            func (b *Batcher[T]) Add(ctx context.Context, item T) error {
            	b.in <- item
            	return nil
            }

            // Close stops accepting items, flushes the pending batch and waits for the loop to exit.
            func (b *Batcher[T]) Close() {
            	close(b.in)
            	<-b.done
            }

            func (b *Batcher[T]) flushLoop(ctx context.Context) {
            	defer close(b.done)
            	defer close(b.out)
            	var batch []T
            	var timer <-chan time.Time
            	flush := func() {
            		if len(batch) > 0 {
            			b.out <- batch
            			batch = nil
            		}
            		timer = nil
            	}
            	for {
            		select {
            		case item, ok := <-b.in:
            			if !ok {
            				flush()
            				return
            			}
            			if len(batch) == 0 {
            				timer = time.After(b.maxDelay)
            			}
            			batch = append(batch, item)
            			if len(batch) >= b.maxSize {
            				flush()
            			}
            		case <-timer:
            			flush()
            		case <-ctx.Done():
            			return
            		}
            	}
            }
        ''')),
        ("example_test.go", dedent('''
            package batcher_test

            import (
            	"context"
            	"fmt"
            	"time"

            	"github.com/streamforge/batcher"
            )

            func Example() {
            	ctx := context.Background()
            	b := batcher.New[int](ctx, 3, 50*time.Millisecond)
            	go func() {
            		for i := 1; i <= 7; i++ {
            			_ = b.Add(ctx, i)
            		}
            		b.Close()
            	}()
            	for batch := range b.Out() {
            		fmt.Println(batch)
            	}
            	// Output:
            	// [1 2 3]
            	// [4 5 6]
            	// [7]
            }
        ''')),
    ],
    trace=dedent("""
        $ go test -run TestBatcherCancelWhileConsumerGone -count=1 -timeout 10s ./...
        panic: test timed out after 10s
        	running tests:
        		TestBatcherCancelWhileConsumerGone (10s)

        goroutine 21 [chan send]:
        github.com/streamforge/batcher.(*Batcher[...]).flushLoop.func1()
        	/src/batcher.go:58 +0x4f
        github.com/streamforge/batcher.(*Batcher[...]).flushLoop(0xc0000a0080, {0x5c9e08, 0xc0000a4050})
        	/src/batcher.go:74 +0x1e5
        created by github.com/streamforge/batcher.New[...] in goroutine 20
        	/src/batcher.go:27 +0x13a

        goroutine 20 [chan receive]:
        github.com/streamforge/batcher.(*Batcher[...]).Close(...)
        	/src/batcher.go:44
        github.com/streamforge/batcher.TestBatcherCancelWhileConsumerGone(0xc0000036c0)
        	/src/batcher_test.go:61 +0x1b8
        FAIL	github.com/streamforge/batcher	10.014s
    """),
    test=("batcher_test.go", dedent('''
        package batcher

        import (
        	"context"
        	"errors"
        	"testing"
        	"time"

        	"go.uber.org/goleak"
        )

        func TestBatcherCancelWhileConsumerGone(t *testing.T) {
        	defer goleak.VerifyNone(t)
        	ctx, cancel := context.WithCancel(context.Background())
        	b := New[int](ctx, 2, time.Hour)
        	// Nobody reads Out(): the first full batch blocks in flushLoop.
        	_ = b.Add(ctx, 1)
        	_ = b.Add(ctx, 2)
        	cancel()

        	errc := make(chan error, 1)
        	go func() { errc <- b.Add(ctx, 3) }()
        	select {
        	case err := <-errc:
        		if !errors.Is(err, context.Canceled) {
        			t.Fatalf("Add after cancel: %v", err)
        		}
        	case <-time.After(time.Second):
        		t.Fatal("Add blocked after cancel")
        	}

        	closed := make(chan struct{})
        	go func() { b.Close(); close(closed) }()
        	select {
        	case <-closed:
        	case <-time.After(time.Second):
        		t.Fatal("Close blocked after cancel")
        	}
        	if got := b.Pending(); len(got) != 2 {
        		t.Fatalf("Pending() = %v, want the undelivered [1 2]", got)
        	}
        }
    ''')),
    test_output=dedent("""
        $ go test -run TestBatcher -count=1 ./...
        # github.com/streamforge/batcher [github.com/streamforge/batcher.test]
        ./batcher_test.go:39:14: b.Pending undefined (type *Batcher[int] has no field or method Pending)
        FAIL	github.com/streamforge/batcher [build failed]
        FAIL

        (with the Pending check commented out)
        --- FAIL: TestBatcherCancelWhileConsumerGone (1.00s)
            batcher_test.go:26: Add blocked after cancel
            leaks.go:78: found unexpected goroutines:
                [Goroutine 7 in state chan send, with github.com/streamforge/batcher.(*Batcher[...]).flushLoop.func1 on top of the stack:
                github.com/streamforge/batcher.(*Batcher[...]).flushLoop.func1()
                	/src/batcher.go:58 +0x4f
                ]
        FAIL
    """),
    commits=[
        "e4d3a02 Generic Batcher[T]",
        "8f7c1b9 Flush on maxDelay measured from the first item",
        "12ab9e0 Add example",
    ],
)

# ------------------------------------------------------------------------------------------------ TypeScript: stale closure
scenario(
    repo="formwell/formwell",
    lang="TypeScript",
    test_cmd="npx vitest run packages/core",
    title="Async validator reports an error for a value the user has already corrected",
    issue=dedent("""
        **Version:** @formwell/core 3.2.0, @formwell/react 3.2.0, React 18.3

        I have a username field with an async "is this name taken?" validator (`debounceMs: 300`). Two
        different things go wrong, both in `createDebouncedValidator`:

        1. **The wrong value is validated.** When I type `bob` quickly, the request that fires 300 ms later is
           for `b`, not `bob`. `lastValue` is only assigned when a new burst starts (`timer === undefined`), so
           later keystrokes in the same burst reset the timer but keep the first value of the burst.
        2. **Results are applied in arrival order, not request order.** If I paste `ann` (taken), the request
           goes out; if I then type `a` so the value is `anna`, the `anna` request is sent too. On our backend
           the `ann` lookup is slower (cache miss) than the `anna` one, so its result arrives last and the field
           ends up showing "Username ann is taken" while the input says `anna`.

        Expected: only the result for the *latest* value is ever applied; outdated in-flight requests are
        aborted (the validator already accepts an `AbortSignal` in its type, but it is never passed) or at
        least ignored. `isValidating` should stay true from the first keystroke until the latest result
        arrives.

        Also, every call to `validate()` wraps `onResult` in another closure and never unwraps it, so a field
        that is edited a lot accumulates closures (and resolves old promises with new results).

        Repro tests below use fake timers. Happy to send a PR if you agree on the approach (a monotonically
        increasing request id per field plus an AbortController).
    """),
    tree=dedent("""
        formwell/
        ├── package.json
        ├── packages/
        │   ├── core/
        │   │   ├── src/
        │   │   │   ├── field.ts
        │   │   │   ├── form.ts
        │   │   │   ├── validate.ts
        │   │   │   └── index.ts
        │   │   └── test/
        │   │       └── validate.test.ts
        │   └── react/
        │       └── src/useField.ts
        └── vitest.workspace.ts
    """),
    files=[
        ("packages/core/src/validate.ts", dedent('''
            export type ValidationResult = string | undefined;

            export type AsyncValidator<V> = (value: V, signal?: AbortSignal) => Promise<ValidationResult>;

            export interface DebouncedValidator<V> {
              /** Schedule validation of `value`; resolves with the result that applies to this value. */
              validate(value: V): Promise<ValidationResult>;
              cancel(): void;
              readonly pending: boolean;
            }

            export function createDebouncedValidator<V>(
              validator: AsyncValidator<V>,
              debounceMs: number,
              onResult: (result: ValidationResult) => void,
            ): DebouncedValidator<V> {
              let timer: ReturnType<typeof setTimeout> | undefined;
              let pending = false;
              let lastValue: V | undefined;
              let run: (() => void) | undefined;

              return {
                validate(value: V) {
                  pending = true;
                  if (timer === undefined) {
                    lastValue = value;
                    run = () => {
                      timer = undefined;
                      validator(lastValue as V).then((result) => {
                        pending = false;
                        onResult(result);
                      });
                    };
                  }
                  if (timer !== undefined) clearTimeout(timer);
                  timer = setTimeout(run!, debounceMs);
                  return new Promise((resolve) => {
                    const previous = onResult;
                    onResult = (result) => {
                      previous(result);
                      resolve(result);
                    };
                  });
                },
                cancel() {
                  if (timer !== undefined) clearTimeout(timer);
                  timer = undefined;
                  pending = false;
                },
                get pending() {
                  return pending;
                },
              };
            }
        ''')),
        ("packages/core/src/field.ts", dedent('''
            import { createDebouncedValidator, type AsyncValidator, type ValidationResult } from "./validate";

            export interface FieldOptions<V> {
              initial: V;
              validate?: (value: V) => ValidationResult;
              validateAsync?: AsyncValidator<V>;
              debounceMs?: number;
            }

            export interface FieldState<V> {
              value: V;
              error: ValidationResult;
              touched: boolean;
              isValidating: boolean;
            }

            type Listener<V> = (state: FieldState<V>) => void;

            export class Field<V> {
              private state: FieldState<V>;
              private listeners = new Set<Listener<V>>();
              private readonly debounced;

              constructor(private readonly options: FieldOptions<V>) {
                this.state = { value: options.initial, error: undefined, touched: false, isValidating: false };
                this.debounced = options.validateAsync
                  ? createDebouncedValidator(options.validateAsync, options.debounceMs ?? 250, (error) =>
                      this.update({ error, isValidating: false }),
                    )
                  : undefined;
              }

              get current(): FieldState<V> {
                return this.state;
              }

              setValue(value: V): void {
                const syncError = this.options.validate?.(value);
                this.update({ value, touched: true, error: syncError });
                if (syncError === undefined && this.debounced) {
                  this.update({ isValidating: true });
                  void this.debounced.validate(value);
                }
              }

              subscribe(listener: Listener<V>): () => void {
                this.listeners.add(listener);
                return () => this.listeners.delete(listener);
              }

              private update(patch: Partial<FieldState<V>>): void {
                this.state = { ...this.state, ...patch };
                for (const listener of this.listeners) listener(this.state);
              }
            }
        ''')),
    ],
    trace=dedent("""
        (browser console, with a logging validator)
        [validate] scheduled "b"      t=+0ms
        [validate] scheduled "bo"     t=+90ms
        [validate] scheduled "bob"    t=+170ms
        [validate] request   "b"      t=+470ms   <- should be "bob"
        [validate] response  "b" -> undefined
        field state: { value: "bob", error: undefined, isValidating: false }   <- "bob" is taken

        [validate] scheduled "ann"    t=+0ms     (pasted)
        [validate] request   "ann"    t=+301ms
        [validate] scheduled "anna"   t=+420ms
        [validate] request   "anna"   t=+721ms
        [validate] response  "anna" -> undefined                 t=+768ms
        [validate] response  "ann" -> "Username ann is taken"    t=+905ms
        field state: { value: "anna", error: "Username ann is taken", isValidating: false }
    """),
    test=("packages/core/test/validate.test.ts", dedent('''
        import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
        import { Field } from "../src/field";

        function usernameField(delays: Record<string, number>, seen: string[]) {
          return new Field<string>({
            initial: "",
            debounceMs: 300,
            validateAsync: (value) => {
              seen.push(value);
              return new Promise((resolve) =>
                setTimeout(() => resolve(["ann", "bob"].includes(value) ? `Username ${value} is taken` : undefined),
                  delays[value] ?? 20),
              );
            },
          });
        }

        describe("async validation", () => {
          beforeEach(() => vi.useFakeTimers());
          afterEach(() => vi.useRealTimers());

          it("validates the latest value of a burst of keystrokes", async () => {
            const seen: string[] = [];
            const field = usernameField({}, seen);
            field.setValue("b");
            await vi.advanceTimersByTimeAsync(100);
            field.setValue("bo");
            await vi.advanceTimersByTimeAsync(100);
            field.setValue("bob");
            await vi.advanceTimersByTimeAsync(400);
            expect(seen).toEqual(["bob"]);
            expect(field.current.error).toBe("Username bob is taken");
          });

          it("ignores the result of an outdated request", async () => {
            const seen: string[] = [];
            const field = usernameField({ ann: 500, anna: 50 }, seen);
            field.setValue("ann");
            await vi.advanceTimersByTimeAsync(310); // "ann" request in flight
            field.setValue("anna");
            expect(field.current.isValidating).toBe(true);
            await vi.advanceTimersByTimeAsync(1000);
            expect(seen).toEqual(["ann", "anna"]);
            expect(field.current.error).toBeUndefined();
            expect(field.current.isValidating).toBe(false);
          });
        });
    ''')),
    test_output=dedent("""
        $ npx vitest run packages/core

         ❯ packages/core/test/validate.test.ts (2)
           ❯ async validation (2)
             × validates the latest value of a burst of keystrokes
             × ignores the result of an outdated request

        ⎯⎯⎯⎯⎯⎯⎯ Failed Tests 2 ⎯⎯⎯⎯⎯⎯⎯

         FAIL  packages/core/test/validate.test.ts > async validation > validates the latest value of a burst of keystrokes
        AssertionError: expected [ 'b' ] to deeply equal [ 'bob' ]

        - Expected
        + Received

          Array [
        -   "bob",
        +   "b",
          ]

         ❯ packages/core/test/validate.test.ts:33:18

         FAIL  packages/core/test/validate.test.ts > async validation > ignores the result of an outdated request
        AssertionError: expected 'Username ann is taken' to be undefined

        - Expected:
        undefined

        + Received:
        "Username ann is taken"

         ❯ packages/core/test/validate.test.ts:45:33
             43|     await vi.advanceTimersByTimeAsync(1000);
             44|     expect(seen).toEqual(["ann", "anna"]);
             45|     expect(field.current.error).toBeUndefined();
               |                                 ^
             46|     expect(field.current.isValidating).toBe(false);

         Test Files  1 failed | 6 passed (7)
              Tests  2 failed | 48 passed (50)
           Duration  1.42s
    """),
    commits=[
        "c81d0f2 core: debounce async validators (debounceMs option)",
        "5e2a7b4 react: expose isValidating from useField",
        "09f3ac1 chore: vitest 1.6",
    ],
)

# ------------------------------------------------------------------------------------------------ JavaScript: rate limiter
scenario(
    repo="mossbank/ratelimit-lite",
    lang="JavaScript",
    test_cmd="npm test",
    title="All users behind our load balancer share one rate-limit bucket; memory grows without bound",
    issue=dedent("""
        We run `ratelimit-lite` behind an AWS ALB with `trustProxy: true`. Two problems:

        **1. Everyone is limited together.** The ALB appends to `X-Forwarded-For`, so the header looks like
        `203.0.113.7, 10.0.3.12`. `clientKey()` splits on `","` but does not trim, and takes the *last* entry,
        which is the load balancer's own address. So every client gets the key `" 10.0.3.12"` (with a leading
        space) and after 100 requests per minute *all* users get 429s. With one trusted proxy hop the client is
        the entry right before the proxies, i.e. `203.0.113.7`. The docs say `trustProxy` can also be a number
        of hops, but the code only checks truthiness.

        **2. Memory leak.** The `hits` Map is never pruned. Each unique key stays forever with an expired
        window. Our public API sees a few million distinct IPs per day; RSS grew to 2.3 GB before the
        container was OOM-killed. There is a `cleanupIntervalMs` option in the README but I cannot find where
        it is used.

        Environment: Node 20.12, express 4.19, ratelimit-lite 0.6.1.
    """),
    tree=dedent("""
        ratelimit-lite/
        ├── package.json
        ├── README.md
        ├── src/
        │   ├── index.js
        │   ├── key.js
        │   └── store.js
        └── test/
            ├── key.test.js
            └── store.test.js
    """),
    files=[
        ("src/index.js", dedent('''
            'use strict';

            const { MemoryStore } = require('./store');
            const { clientKey } = require('./key');

            function rateLimit(options = {}) {
              const {
                windowMs = 60_000,
                max = 100,
                trustProxy = false,
                cleanupIntervalMs = 60_000,
                keyGenerator = (req) => clientKey(req, trustProxy),
                store = new MemoryStore({ windowMs }),
                message = 'Too many requests, please try again later.',
              } = options;

              return function rateLimitMiddleware(req, res, next) {
                const key = keyGenerator(req);
                const { count, resetAt } = store.increment(key, Date.now());
                res.setHeader('RateLimit-Limit', String(max));
                res.setHeader('RateLimit-Remaining', String(Math.max(0, max - count)));
                res.setHeader('RateLimit-Reset', String(Math.ceil((resetAt - Date.now()) / 1000)));
                if (count > max) {
                  res.setHeader('Retry-After', String(Math.ceil((resetAt - Date.now()) / 1000)));
                  res.status(429).send(message);
                  return;
                }
                next();
              };
            }

            module.exports = { rateLimit, MemoryStore };
        ''')),
        ("src/key.js", dedent('''
            'use strict';

            /**
             * The key a request is counted under: the client's IP address.
             * @param {import('http').IncomingMessage} req
             * @param {boolean|number} trustProxy  false: use the socket address; true or a number of hops:
             *   take the client address from X-Forwarded-For, skipping that many trusted proxies (true = 1).
             */
            function clientKey(req, trustProxy) {
              if (trustProxy) {
                const header = req.headers['x-forwarded-for'];
                if (header) {
                  const parts = header.split(',');
                  return parts[parts.length - 1];
                }
              }
              return req.socket.remoteAddress || 'unknown';
            }

            module.exports = { clientKey };
        ''')),
        ("src/store.js", dedent('''
            'use strict';

            class MemoryStore {
              constructor({ windowMs }) {
                this.windowMs = windowMs;
                this.hits = new Map();
              }

              increment(key, now) {
                let entry = this.hits.get(key);
                if (!entry || entry.resetAt <= now) {
                  entry = { count: 0, resetAt: now + this.windowMs };
                  this.hits.set(key, entry);
                }
                entry.count += 1;
                return { count: entry.count, resetAt: entry.resetAt };
              }

              reset(key) {
                this.hits.delete(key);
              }

              get size() {
                return this.hits.size;
              }
            }

            module.exports = { MemoryStore };
        ''')),
    ],
    trace=dedent("""
        $ for i in 1 2 3; do curl -s -D - -o /dev/null -H "X-Forwarded-For: 198.51.100.$i, 10.0.3.12" localhost:3000/api/ping | grep -i remaining; done
        RateLimit-Remaining: 99
        RateLimit-Remaining: 98
        RateLimit-Remaining: 97
        $ node -e "const {clientKey}=require('./src/key'); console.log(JSON.stringify(clientKey({headers:{'x-forwarded-for':'203.0.113.7, 10.0.3.12'},socket:{}}, true)))"
        " 10.0.3.12"
        $ node --expose-gc scripts/soak.js --unique-keys 2000000
        after 2,000,000 unique keys: store.size = 2000000, heapUsed = 412.6 MB
        after gc + 2 windows idle:  store.size = 2000000, heapUsed = 409.8 MB
    """),
    test=("test/key.test.js", dedent('''
        'use strict';

        const test = require('node:test');
        const assert = require('node:assert/strict');
        const { clientKey } = require('../src/key');
        const { MemoryStore } = require('../src/store');

        const req = (xff, remote = '10.0.3.12') => ({ headers: xff ? { 'x-forwarded-for': xff } : {}, socket: { remoteAddress: remote } });

        test('one trusted hop takes the entry before the proxy', () => {
          assert.equal(clientKey(req('203.0.113.7, 10.0.3.12'), true), '203.0.113.7');
          assert.equal(clientKey(req('203.0.113.7, 10.0.3.12'), 1), '203.0.113.7');
        });

        test('two trusted hops', () => {
          assert.equal(clientKey(req('198.51.100.4, 203.0.113.7, 10.0.3.12'), 2), '198.51.100.4');
        });

        test('spoofed header without proxy is ignored', () => {
          assert.equal(clientKey(req('1.2.3.4', '198.51.100.9'), false), '198.51.100.9');
        });

        test('expired entries are pruned', () => {
          const store = new MemoryStore({ windowMs: 1000 });
          for (let i = 0; i < 100; i++) store.increment(`k${i}`, 0);
          store.prune(5000);
          assert.equal(store.size, 0);
        });
    ''')),
    test_output=dedent("""
        $ npm test

        > ratelimit-lite@0.6.1 test
        > node --test test/

        ✖ one trusted hop takes the entry before the proxy (1.2ms)
          AssertionError [ERR_ASSERTION]: Expected values to be strictly equal:
          + actual - expected

          + ' 10.0.3.12'
          - '203.0.113.7'
              at TestContext.<anonymous> (/src/test/key.test.js:10:10)
        ✖ two trusted hops (0.3ms)
          AssertionError [ERR_ASSERTION]: Expected values to be strictly equal:
          + ' 10.0.3.12'
          - '198.51.100.4'
        ✔ spoofed header without proxy is ignored (0.2ms)
        ✖ expired entries are pruned (0.4ms)
          TypeError [Error]: store.prune is not a function
              at TestContext.<anonymous> (/src/test/key.test.js:25:9)
        ℹ tests 4
        ℹ pass 1
        ℹ fail 3
    """),
    commits=[
        "b3f9d71 Document cleanupIntervalMs and trustProxy hops",
        "6a02e54 Send RateLimit-* headers (draft-7)",
        "e19c4a0 trustProxy option",
    ],
)

# ------------------------------------------------------------------------------------------------ JavaScript: dates
scenario(
    repo="calloway/tinydate",
    lang="JavaScript",
    test_cmd="TZ=America/Los_Angeles npx vitest run",
    title="formatDate('2024-03-10') shows March 9 for users west of UTC",
    issue=dedent("""
        Our booking widget displays the check-in date with `formatDate(booking.checkIn, 'ddd D MMM')`, where
        `checkIn` is a date-only string from the API (`"2024-03-10"`). Customers in the Americas see
        "Sat 9 Mar" instead of "Sun 10 Mar". Customers in Europe and Asia see the right date.

        I believe `parse()` passes date-only strings straight to `new Date(str)`. Per the ECMAScript spec,
        date-only ISO strings are parsed as **UTC** midnight, while date-time strings without an offset
        (`"2024-03-10T00:00"`) are parsed as **local** time. So `"2024-03-10"` becomes 2024-03-09 16:00 in
        Los Angeles, and every getter (`getDate()`, `getDay()`) we use for formatting is local.

        `addDays()` has a related problem around DST: it adds `days * 86400000` ms to the timestamp, so adding
        1 day to `2024-03-10T00:00` local in Los Angeles gives `2024-03-11T01:00`, and formatting with `HH:mm`
        shows 01:00. For calendar arithmetic the wall-clock time should stay the same.

        Expected:
        * date-only strings are treated as local calendar dates (this is what the README promises: "a date
          without a time is a calendar date, not an instant");
        * `addDays` keeps the local time of day across DST changes;
        * strings with an explicit offset or `Z` keep their current meaning.

        tinydate 2.1.4; reproduced in Chrome 125, Firefox 126 and Node 20 with `TZ=America/Los_Angeles`.
    """),
    tree=dedent("""
        tinydate/
        ├── package.json
        ├── README.md
        ├── src/
        │   ├── index.js
        │   ├── parse.js
        │   ├── format.js
        │   ├── arithmetic.js
        │   └── locale/
        │       ├── en.js
        │       └── de.js
        └── test/
            ├── parse.test.js
            ├── format.test.js
            └── arithmetic.test.js
    """),
    files=[
        ("src/parse.js", dedent('''
            const ISO_DATE = /^(\\d{4})-(\\d{2})-(\\d{2})$/;
            const ISO_DATE_TIME = /^(\\d{4})-(\\d{2})-(\\d{2})[T ](\\d{2}):(\\d{2})(?::(\\d{2})(?:\\.(\\d{1,3}))?)?(Z|[+-]\\d{2}:?\\d{2})?$/;

            /**
             * Parse a Date, a timestamp in milliseconds, or an ISO 8601 string.
             * Returns an Invalid Date for anything else (check with isValid()).
             */
            export function parse(input) {
              if (input instanceof Date) return new Date(input.getTime());
              if (typeof input === 'number') return new Date(input);
              if (typeof input !== 'string') return new Date(NaN);

              const text = input.trim();
              if (ISO_DATE.test(text)) {
                return new Date(text);
              }
              const m = ISO_DATE_TIME.exec(text);
              if (m) {
                const [, y, mo, d, h, mi, s = '0', ms = '0', zone] = m;
                if (zone) return new Date(text.replace(' ', 'T'));
                return new Date(+y, +mo - 1, +d, +h, +mi, +s, +ms.padEnd(3, '0'));
              }
              return new Date(NaN);
            }

            export function isValid(date) {
              return date instanceof Date && !Number.isNaN(date.getTime());
            }
        ''')),
        ("src/arithmetic.js", dedent('''
            import { parse } from './parse.js';

            const MS_PER_DAY = 24 * 60 * 60 * 1000;

            export function addDays(input, days) {
              const date = parse(input);
              return new Date(date.getTime() + days * MS_PER_DAY);
            }

            export function addMonths(input, months) {
              const date = parse(input);
              const day = date.getDate();
              const result = new Date(date.getTime());
              result.setDate(1);
              result.setMonth(result.getMonth() + months);
              const lastDay = new Date(result.getFullYear(), result.getMonth() + 1, 0).getDate();
              result.setDate(Math.min(day, lastDay));
              return result;
            }

            export function differenceInCalendarDays(a, b) {
              const start = parse(a);
              const end = parse(b);
              const utcA = Date.UTC(start.getFullYear(), start.getMonth(), start.getDate());
              const utcB = Date.UTC(end.getFullYear(), end.getMonth(), end.getDate());
              return Math.round((utcA - utcB) / MS_PER_DAY);
            }
        ''')),
        ("src/format.js", dedent('''
            import { parse, isValid } from './parse.js';
            import en from './locale/en.js';

            const TOKENS = /YYYY|MMM|MM|M|DD|D|ddd|HH|mm|ss/g;

            const pad = (n, width = 2) => String(n).padStart(width, '0');

            export function formatDate(input, pattern = 'YYYY-MM-DD', locale = en) {
              const date = parse(input);
              if (!isValid(date)) return 'Invalid Date';
              return pattern.replace(TOKENS, (token) => {
                switch (token) {
                  case 'YYYY': return String(date.getFullYear());
                  case 'MMM': return locale.monthsShort[date.getMonth()];
                  case 'MM': return pad(date.getMonth() + 1);
                  case 'M': return String(date.getMonth() + 1);
                  case 'DD': return pad(date.getDate());
                  case 'D': return String(date.getDate());
                  case 'ddd': return locale.weekdaysShort[date.getDay()];
                  case 'HH': return pad(date.getHours());
                  case 'mm': return pad(date.getMinutes());
                  case 'ss': return pad(date.getSeconds());
                  default: return token;
                }
              });
            }
        ''')),
    ],
    trace=dedent("""
        $ TZ=America/Los_Angeles node --input-type=module -e "
          import { formatDate, addDays } from './src/index.js';
          console.log(formatDate('2024-03-10', 'ddd D MMM'));
          console.log(formatDate(addDays('2024-03-10T00:00', 1), 'YYYY-MM-DD HH:mm'));
          console.log(formatDate('2024-03-10T00:00Z', 'YYYY-MM-DD HH:mm'));"
        Sat 9 Mar
        2024-03-11 01:00
        2024-03-09 16:00
        $ TZ=Europe/Berlin node --input-type=module -e "import { formatDate } from './src/index.js'; console.log(formatDate('2024-03-10', 'ddd D MMM'))"
        Sun 10 Mar
    """),
    test=("test/arithmetic.test.js", dedent('''
        import { describe, expect, it } from 'vitest';
        import { addDays, differenceInCalendarDays } from '../src/arithmetic.js';
        import { formatDate } from '../src/format.js';

        // Run with TZ=America/Los_Angeles (see package.json "test" script).
        describe('calendar dates', () => {
          it('treats date-only strings as local calendar dates', () => {
            expect(formatDate('2024-03-10', 'ddd D MMM')).toBe('Sun 10 Mar');
            expect(formatDate('2024-01-01')).toBe('2024-01-01');
          });

          it('keeps the wall-clock time when adding days across DST', () => {
            expect(formatDate(addDays('2024-03-10T00:00', 1), 'YYYY-MM-DD HH:mm')).toBe('2024-03-11 00:00');
            expect(formatDate(addDays('2024-11-02T12:30', 2), 'YYYY-MM-DD HH:mm')).toBe('2024-11-04 12:30');
          });

          it('counts calendar days', () => {
            expect(differenceInCalendarDays('2024-03-11', '2024-03-09')).toBe(2);
          });

          it('keeps explicit offsets', () => {
            expect(formatDate('2024-03-10T00:00Z', 'YYYY-MM-DD HH:mm')).toBe('2024-03-09 16:00');
          });
        });
    ''')),
    test_output=dedent("""
        $ TZ=America/Los_Angeles npx vitest run

         ❯ test/arithmetic.test.js (4)
           ❯ calendar dates (4)
             × treats date-only strings as local calendar dates
             × keeps the wall-clock time when adding days across DST
             ✓ counts calendar days
             ✓ keeps explicit offsets

         FAIL  test/arithmetic.test.js > calendar dates > treats date-only strings as local calendar dates
        AssertionError: expected 'Sat 9 Mar' to be 'Sun 10 Mar' // Object.is equality
         ❯ test/arithmetic.test.js:8:51

         FAIL  test/arithmetic.test.js > calendar dates > keeps the wall-clock time when adding days across DST
        AssertionError: expected '2024-03-11 01:00' to be '2024-03-11 00:00' // Object.is equality
         ❯ test/arithmetic.test.js:13:75

         Test Files  1 failed | 2 passed (3)
              Tests  2 failed | 31 passed (33)
    """),
    commits=[
        "4c0a9b1 differenceInCalendarDays: compare calendar dates via Date.UTC",
        "aa71f3e format: ddd token",
        "5fd2e80 parse: accept a space instead of T",
    ],
)

# ------------------------------------------------------------------------------------------------ TypeScript: CLI flags
scenario(
    repo="lanternworks/flagship",
    lang="TypeScript",
    test_cmd="npm test -- src/parse.test.ts",
    title="--port 0 falls back to the default port, and --no-color is ignored when NO_COLOR is unset",
    issue=dedent("""
        Hi! Two small but annoying bugs in the argument parser, found while writing tests for our dev server
        (which uses `--port 0` to let the OS pick a free port):

        1. `mycli serve --port 0` starts on port 8080 (the default). In `applyDefaults` the code does
           `result[name] = result[name] || option.default`, so any falsy value (`0`, `""`, `false`) is replaced
           by the default. Same with `--retries 0` and `--prefix ""`.

        2. `--no-color` sets `color` to `undefined` instead of `false` when the option is declared as
           `{ type: "boolean", default: true }`. Then `applyDefaults` turns it back into `true`. With the `NO_COLOR`
           environment variable set, colour is off, so it looked like it worked on my machine.

        Also, `--port=abc` silently becomes `NaN`; I would expect a `ParseError` like the one for unknown
        options ("Invalid value for --port: expected a number, got 'abc'").

        flagship 1.9.0, TypeScript 5.4, Node 20.
    """),
    tree=dedent("""
        flagship/
        ├── package.json
        ├── tsconfig.json
        └── src/
            ├── index.ts
            ├── parse.ts
            ├── parse.test.ts
            ├── help.ts
            └── types.ts
    """),
    files=[
        ("src/types.ts", dedent('''
            export type OptionType = "string" | "number" | "boolean";

            export interface OptionSpec {
              type: OptionType;
              alias?: string;
              default?: string | number | boolean;
              description?: string;
              env?: string;
            }

            export type Spec = Record<string, OptionSpec>;

            export type Parsed = {
              options: Record<string, string | number | boolean | undefined>;
              positionals: string[];
            };

            export class ParseError extends Error {
              constructor(message: string) {
                super(message);
                this.name = "ParseError";
              }
            }
        ''')),
        ("src/parse.ts", dedent('''
            import { ParseError, type OptionSpec, type Parsed, type Spec } from "./types";

            function findOption(spec: Spec, flag: string): [string, OptionSpec] | undefined {
              if (spec[flag]) return [flag, spec[flag]];
              for (const [name, option] of Object.entries(spec)) {
                if (option.alias === flag) return [name, option];
              }
              return undefined;
            }

            function convert(option: OptionSpec, raw: string): string | number | boolean {
              switch (option.type) {
                case "number":
                  return Number(raw);
                case "boolean":
                  return raw !== "false" && raw !== "0";
                default:
                  return raw;
              }
            }

            export function parseArgs(argv: string[], spec: Spec, env: NodeJS.ProcessEnv = process.env): Parsed {
              const options: Parsed["options"] = {};
              const positionals: string[] = [];

              for (let i = 0; i < argv.length; i++) {
                const arg = argv[i];
                if (arg === "--") {
                  positionals.push(...argv.slice(i + 1));
                  break;
                }
                if (!arg.startsWith("-") || arg === "-") {
                  positionals.push(arg);
                  continue;
                }
                let [flag, inline] = arg.replace(/^--?/, "").split(/=(.*)/s, 2) as [string, string | undefined];
                let negated = false;
                if (flag.startsWith("no-") && !spec[flag]) {
                  flag = flag.slice(3);
                  negated = true;
                }
                const found = findOption(spec, flag);
                if (!found) throw new ParseError(`Unknown option: ${arg}`);
                const [name, option] = found;
                if (option.type === "boolean") {
                  options[name] = negated ? undefined : inline === undefined ? true : convert(option, inline);
                  continue;
                }
                const raw = inline ?? argv[++i];
                if (raw === undefined) throw new ParseError(`Option --${name} needs a value`);
                options[name] = convert(option, raw);
              }

              applyDefaults(options, spec, env);
              return { options, positionals };
            }

            function applyDefaults(result: Parsed["options"], spec: Spec, env: NodeJS.ProcessEnv): void {
              for (const [name, option] of Object.entries(spec)) {
                if (option.env && env[option.env] !== undefined && result[name] === undefined) {
                  result[name] = convert(option, env[option.env]!);
                }
                result[name] = result[name] || option.default;
              }
            }
        ''')),
        ("src/index.ts", dedent('''
            export { parseArgs } from "./parse";
            export { formatHelp } from "./help";
            export { ParseError, type OptionSpec, type Spec, type Parsed } from "./types";

            /** Convenience wrapper: parse process.argv, print help on --help, exit 2 on errors. */
            export function cli(spec: import("./types").Spec, argv = process.argv.slice(2)) {
              const { parseArgs } = require("./parse") as typeof import("./parse");
              const { formatHelp } = require("./help") as typeof import("./help");
              try {
                const parsed = parseArgs(argv, spec);
                if (parsed.options.help) {
                  process.stdout.write(formatHelp(spec));
                  process.exit(0);
                }
                return parsed;
              } catch (error) {
                process.stderr.write(`${(error as Error).message}\\n\\n${formatHelp(spec)}`);
                process.exit(2);
              }
            }
        ''')),
    ],
    trace=dedent("""
        $ node -e 'const {parseArgs}=require("./dist"); console.log(parseArgs(process.argv.slice(1), {port:{type:"number",default:8080}, color:{type:"boolean",default:true,env:"FORCE_COLOR"}, retries:{type:"number",default:3}}).options)' -- --port 0 --no-color --retries 0
        { port: 8080, color: true, retries: 3 }
        $ node -e '...same...' -- --port=abc
        { port: NaN, color: true, retries: 3 }
    """),
    test=("src/parse.test.ts", dedent('''
        import { describe, expect, it } from "vitest";
        import { parseArgs } from "./parse";
        import { ParseError, type Spec } from "./types";

        const spec: Spec = {
          port: { type: "number", default: 8080, alias: "p" },
          color: { type: "boolean", default: true, env: "FORCE_COLOR" },
          prefix: { type: "string", default: "/api" },
          retries: { type: "number", default: 3 },
        };

        describe("parseArgs", () => {
          it("keeps falsy values given explicitly", () => {
            const { options } = parseArgs(["--port", "0", "--retries=0", "--prefix", ""], spec, {});
            expect(options).toMatchObject({ port: 0, retries: 0, prefix: "" });
          });

          it("negates booleans with --no-", () => {
            expect(parseArgs(["--no-color"], spec, {}).options.color).toBe(false);
          });

          it("uses defaults when nothing is given", () => {
            expect(parseArgs([], spec, {}).options).toEqual({ port: 8080, color: true, prefix: "/api", retries: 3 });
          });

          it("rejects non-numeric numbers", () => {
            expect(() => parseArgs(["-p", "abc"], spec, {})).toThrow(ParseError);
          });
        });
    ''')),
    test_output=dedent("""
        $ npm test -- src/parse.test.ts

         FAIL  src/parse.test.ts > parseArgs > keeps falsy values given explicitly
        AssertionError: expected { port: 8080, color: true, …(2) } to match object { port: 0, retries: 0, prefix: '' }

        - Expected
        + Received

          Object {
        -   "port": 0,
        -   "prefix": "",
        -   "retries": 0,
        +   "color": true,
        +   "port": 8080,
        +   "prefix": "/api",
        +   "retries": 3,
          }

         FAIL  src/parse.test.ts > parseArgs > negates booleans with --no-
        AssertionError: expected true to be false // Object.is equality

         FAIL  src/parse.test.ts > parseArgs > rejects non-numeric numbers
        AssertionError: expected [Function] to throw an error

         Test Files  1 failed (1)
              Tests  3 failed | 1 passed (4)
    """),
    commits=[
        "d09b1e7 Support --flag=value with = inside the value",
        "31c5a2f env fallback for options (env: NAME)",
        "8b6e4cc --no-<flag> negation for booleans",
    ],
)

# ------------------------------------------------------------------------------------------------ Rust: UTF-8 slicing
scenario(
    repo="brackish/tomlette",
    lang="Rust",
    test_cmd="cargo test --lib lexer",
    title="Panic 'byte index is not a char boundary' on keys containing non-ASCII characters",
    issue=dedent("""
        Parsing this file panics instead of returning an error or a value:

        ```toml
        [café]
        größe = "L"
        name = "Zoë"   # comment with emoji 🦀
        ```

        ```
        thread 'main' panicked at src/lexer.rs:30:9:
        byte index 5 is not a char boundary; it is inside 'é' (bytes 4..6) of `[café]`
        ```

        Non-ASCII in *quoted* strings works; it is bare keys and comments that break. TOML 1.0 only allows
        `A-Za-z0-9_-` in bare keys, so `[café]` should be a parse error with a line/column, but the lexer
        must not panic on any input: we parse user-supplied config files in a long-running service and the
        panic takes down the worker thread. `größe` outside a table header panics the same way, and so does a
        comment containing an emoji right after a bare key (`a=1#🦀`).

        I ran `cargo fuzz` on the lexer for ten minutes and got six distinct crashes, all in `peek` /
        `peek_str` slicing `self.src[self.pos..]` after `bump` advanced `pos` by one byte per character
        instead of by `c.len_utf8()`. Column numbers in error messages are also off for lines containing multi-byte
        characters (they count bytes, not characters).

        tomlette 0.4.2, rustc 1.79.0.
    """),
    tree=dedent("""
        tomlette/
        ├── Cargo.toml
        ├── fuzz/
        │   └── fuzz_targets/lexer.rs
        └── src/
            ├── lib.rs
            ├── error.rs
            ├── lexer.rs
            ├── parser.rs
            └── value.rs
    """),
    files=[
        ("src/lexer.rs", dedent('''
            use crate::error::{Error, Span};

            #[derive(Debug, Clone, PartialEq)]
            pub enum Token<'a> {
                BareKey(&'a str),
                Str(String),
                Int(i64),
                Equals,
                Dot,
                LBracket,
                RBracket,
                Newline,
                Eof,
            }

            pub struct Lexer<'a> {
                src: &'a str,
                pos: usize,
                line: usize,
                col: usize,
            }

            impl<'a> Lexer<'a> {
                pub fn new(src: &'a str) -> Self {
                    Lexer { src, pos: 0, line: 1, col: 1 }
                }

                fn peek(&self) -> Option<char> {
                    self.src[self.pos..].chars().next()
                }

                fn peek_str(&self, n: usize) -> &'a str {
                    let end = (self.pos + n).min(self.src.len());
                    &self.src[self.pos..end]
                }

                fn bump(&mut self) -> Option<char> {
                    let c = self.peek()?;
                    self.pos += 1;
                    if c == '\\n' {
                        self.line += 1;
                        self.col = 1;
                    } else {
                        self.col += 1;
                    }
                    Some(c)
                }

                fn span(&self) -> Span {
                    Span { line: self.line, col: self.col }
                }

                fn skip_whitespace_and_comments(&mut self) {
                    while let Some(c) = self.peek() {
                        match c {
                            ' ' | '\\t' | '\\r' => {
                                self.bump();
                            }
                            '#' => {
                                while let Some(c) = self.peek() {
                                    if c == '\\n' {
                                        break;
                                    }
                                    self.bump();
                                }
                            }
                            _ => break,
                        }
                    }
                }

                pub fn next_token(&mut self) -> Result<Token<'a>, Error> {
                    self.skip_whitespace_and_comments();
                    let start = self.pos;
                    let span = self.span();
                    let Some(c) = self.peek() else { return Ok(Token::Eof) };
                    match c {
                        '\\n' => { self.bump(); Ok(Token::Newline) }
                        '=' => { self.bump(); Ok(Token::Equals) }
                        '.' => { self.bump(); Ok(Token::Dot) }
                        '[' => { self.bump(); Ok(Token::LBracket) }
                        ']' => { self.bump(); Ok(Token::RBracket) }
                        '"' => self.string(span),
                        c if c.is_ascii_digit() || c == '-' || c == '+' => self.number(span),
                        _ => {
                            while let Some(c) = self.peek() {
                                if c.is_whitespace() || "=.[]#".contains(c) {
                                    break;
                                }
                                self.bump();
                            }
                            let key = &self.src[start..self.pos];
                            if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
                                return Err(Error::new(span, format!("invalid bare key {:?}", self.peek_str(16))));
                            }
                            Ok(Token::BareKey(key))
                        }
                    }
                }
            }
        ''')),
        ("src/error.rs", dedent('''
            use std::fmt;

            #[derive(Debug, Clone, Copy, PartialEq, Eq)]
            pub struct Span {
                pub line: usize,
                /// 1-based column, in characters.
                pub col: usize,
            }

            #[derive(Debug, Clone, PartialEq, Eq)]
            pub struct Error {
                pub span: Span,
                pub message: String,
            }

            impl Error {
                pub fn new(span: Span, message: impl Into<String>) -> Self {
                    Error { span, message: message.into() }
                }
            }

            impl fmt::Display for Error {
                fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    write!(f, "{} at line {}, column {}", self.message, self.span.line, self.span.col)
                }
            }

            impl std::error::Error for Error {}
        ''')),
    ],
    trace=dedent("""
        $ RUST_BACKTRACE=1 cargo run --example parse -- tests/data/unicode_keys.toml
        thread 'main' panicked at src/lexer.rs:30:9:
        byte index 5 is not a char boundary; it is inside 'é' (bytes 4..6) of `[café]\\ngröße = "L"\\nname = "Zoë"   # comment with emoji 🦀\\n`
        stack backtrace:
           0: rust_begin_unwind
           1: core::panicking::panic_fmt
           2: core::str::slice_error_fail_rt
           3: core::str::slice_error_fail
           4: core::str::traits::<impl core::slice::index::SliceIndex<str> for core::ops::range::RangeFrom<usize>>::index::{{closure}}
           5: tomlette::lexer::Lexer::peek
                     at ./src/lexer.rs:30:9
           6: tomlette::lexer::Lexer::next_token
                     at ./src/lexer.rs:86:39
           7: tomlette::parser::Parser::table_header
                     at ./src/parser.rs:64:23
           8: tomlette::parser::Parser::parse_document
                     at ./src/parser.rs:31:17
           9: tomlette::from_str
                     at ./src/lib.rs:18:5
          10: parse::main
                     at ./examples/parse.rs:9:16
        note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.
    """),
    test=("src/lexer.rs (tests module)", dedent('''
        #[cfg(test)]
        mod tests {
            use super::*;

            fn all_tokens(src: &str) -> Result<Vec<Token<'_>>, Error> {
                let mut lexer = Lexer::new(src);
                let mut out = Vec::new();
                loop {
                    let token = lexer.next_token()?;
                    if token == Token::Eof {
                        return Ok(out);
                    }
                    out.push(token);
                }
            }

            #[test]
            fn non_ascii_bare_key_is_an_error_not_a_panic() {
                let err = all_tokens("[café]").unwrap_err();
                assert_eq!(err.span, Span { line: 1, col: 2 });
            }

            #[test]
            fn comment_with_emoji() {
                assert_eq!(
                    all_tokens("a=1#🦀\\nb=2").unwrap(),
                    vec![Token::BareKey("a"), Token::Equals, Token::Int(1), Token::Newline,
                         Token::BareKey("b"), Token::Equals, Token::Int(2)]
                );
            }

            #[test]
            fn columns_count_characters() {
                let err = all_tokens("name = \\"Zoë\\" ?").unwrap_err();
                assert_eq!(err.span, Span { line: 1, col: 14 });
            }
        }
    ''')),
    test_output=dedent("""
        $ cargo test --lib lexer
        running 3 tests
        test lexer::tests::columns_count_characters ... FAILED
        test lexer::tests::comment_with_emoji ... FAILED
        test lexer::tests::non_ascii_bare_key_is_an_error_not_a_panic ... FAILED

        failures:

        ---- lexer::tests::columns_count_characters stdout ----
        thread 'lexer::tests::columns_count_characters' panicked at src/lexer.rs:30:9:
        byte index 11 is not a char boundary; it is inside 'ë' (bytes 10..12) of `name = "Zoë" ?`

        ---- lexer::tests::comment_with_emoji stdout ----
        thread 'lexer::tests::comment_with_emoji' panicked at src/lexer.rs:30:9:
        byte index 5 is not a char boundary; it is inside '🦀' (bytes 4..8) of `a=1#🦀\\nb=2`

        ---- lexer::tests::non_ascii_bare_key_is_an_error_not_a_panic stdout ----
        thread 'lexer::tests::non_ascii_bare_key_is_an_error_not_a_panic' panicked at src/lexer.rs:30:9:
        byte index 5 is not a char boundary; it is inside 'é' (bytes 4..6) of `[café]`

        failures:
            lexer::tests::columns_count_characters
            lexer::tests::comment_with_emoji
            lexer::tests::non_ascii_bare_key_is_an_error_not_a_panic

        test result: FAILED. 0 passed; 3 failed; 0 ignored; 0 measured; 14 filtered out; finished in 0.00s
    """),
    commits=[
        "7e51c0a lexer: report spans in errors",
        "b2a9f44 fuzz: add lexer target",
        "0c6de18 parser: dotted keys",
    ],
)

# ------------------------------------------------------------------------------------------------ Rust: ring buffer
scenario(
    repo="lumen-obs/ringlog",
    lang="Rust",
    test_cmd="cargo test ring",
    title="RingBuffer::iter() returns entries out of order (and drops one) after wrapping",
    issue=dedent("""
        `ringlog` keeps the last N log records in memory for our crash reporter. After the buffer wraps
        around, `iter()` yields records in the wrong order, and `len()` is one less than the capacity even when
        the buffer is full. The crash reports we got this week had the newest record first and the oldest one
        missing, which made them very confusing to read.

        Minimal example with capacity 4, pushing 1 through 6:

        ```rust
        let mut ring = RingBuffer::with_capacity(4);
        for i in 1..=6 { ring.push(i); }
        assert_eq!(ring.iter().copied().collect::<Vec<_>>(), vec![3, 4, 5, 6]); // got [6, 3, 4]
        assert_eq!(ring.len(), 4);                                              // got 3
        ```

        I think the implementation mixes two conventions: `push` treats `head` as "the slot to write next",
        while `iter` and `len` treat it as "the slot of the oldest element", and `len` uses the classic
        "one slot always empty" formula although the buffer has no spare slot. Also `iter()` is
        `O(capacity)` even when the buffer holds two elements, since it walks `self.slots` with a filter.

        Expected: `iter()` yields oldest to newest, `len()` is correct in every state, `drain()` empties the
        buffer. A property test against a `VecDeque` model would be great.
    """),
    tree=dedent("""
        ringlog/
        ├── Cargo.toml
        ├── benches/push.rs
        └── src/
            ├── lib.rs
            ├── record.rs
            ├── ring.rs
            └── sink.rs
    """),
    files=[
        ("src/ring.rs", dedent('''
            /// A fixed-capacity ring buffer that overwrites its oldest element when full.
            pub struct RingBuffer<T> {
                slots: Vec<Option<T>>,
                head: usize,
                full: bool,
            }

            impl<T> RingBuffer<T> {
                pub fn with_capacity(capacity: usize) -> Self {
                    assert!(capacity > 0, "capacity must be positive");
                    let mut slots = Vec::with_capacity(capacity);
                    slots.resize_with(capacity, || None);
                    RingBuffer { slots, head: 0, full: false }
                }

                pub fn capacity(&self) -> usize {
                    self.slots.len()
                }

                /// Append an element, overwriting the oldest one if the buffer is full.
                pub fn push(&mut self, value: T) {
                    self.slots[self.head] = Some(value);
                    self.head = (self.head + 1) % self.capacity();
                    if self.head == 0 {
                        self.full = true;
                    }
                }

                pub fn len(&self) -> usize {
                    if self.full {
                        self.capacity() - 1
                    } else {
                        self.head
                    }
                }

                pub fn is_empty(&self) -> bool {
                    self.len() == 0
                }

                /// Elements from oldest to newest.
                pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
                    let cap = self.capacity();
                    let start = if self.full { (self.head + cap - 1) % cap } else { 0 };
                    (0..cap)
                        .map(move |offset| &self.slots[(start + offset) % cap])
                        .filter_map(|slot| slot.as_ref())
                        .take(self.len())
                }

                /// Remove and return every element, oldest first.
                pub fn drain(&mut self) -> Vec<T> {
                    let mut out = Vec::with_capacity(self.len());
                    for slot in self.slots.iter_mut() {
                        if let Some(value) = slot.take() {
                            out.push(value);
                        }
                    }
                    self.head = 0;
                    self.full = false;
                    out
                }
            }
        ''')),
        ("src/sink.rs", dedent('''
            use std::sync::Mutex;

            use crate::record::Record;
            use crate::ring::RingBuffer;

            /// Keeps the most recent records so they can be attached to a crash report.
            pub struct MemorySink {
                ring: Mutex<RingBuffer<Record>>,
            }

            impl MemorySink {
                pub fn new(capacity: usize) -> Self {
                    MemorySink { ring: Mutex::new(RingBuffer::with_capacity(capacity)) }
                }

                pub fn log(&self, record: Record) {
                    self.ring.lock().expect("ring poisoned").push(record);
                }

                /// Render the buffered records, oldest first, one per line.
                pub fn dump(&self) -> String {
                    let ring = self.ring.lock().expect("ring poisoned");
                    let mut out = String::new();
                    for record in ring.iter() {
                        out.push_str(&record.to_string());
                        out.push('\\n');
                    }
                    out
                }
            }
        ''')),
    ],
    trace=dedent("""
        --- crash report 2024-06-11T03:12:09Z (worker-7) ---
        recent log (expected oldest first, 256 records):
        03:12:09.114 ERROR payment::capture: upstream timeout after 30s (order 88412)
        03:12:01.002 INFO  http: POST /v1/capture 200 41ms
        03:12:01.090 INFO  http: GET /healthz 200 0ms
        03:12:02.377 WARN  payment::capture: retrying capture for order 88412 (attempt 2)
        ...
        (255 records; the record logged at 03:12:00.981 is missing)
    """),
    test=("src/ring.rs (tests module)", dedent('''
        #[cfg(test)]
        mod tests {
            use super::RingBuffer;
            use std::collections::VecDeque;

            #[test]
            fn wraps_in_order() {
                let mut ring = RingBuffer::with_capacity(4);
                for i in 1..=6 {
                    ring.push(i);
                }
                assert_eq!(ring.iter().copied().collect::<Vec<_>>(), vec![3, 4, 5, 6]);
                assert_eq!(ring.len(), 4);
                assert_eq!(ring.drain(), vec![3, 4, 5, 6]);
                assert!(ring.is_empty());
            }

            #[test]
            fn matches_vecdeque_model() {
                for cap in 1..6 {
                    let mut ring = RingBuffer::with_capacity(cap);
                    let mut model = VecDeque::new();
                    for i in 0..20 {
                        ring.push(i);
                        model.push_back(i);
                        if model.len() > cap {
                            model.pop_front();
                        }
                        assert_eq!(ring.len(), model.len(), "cap {cap}, after pushing {i}");
                        assert!(ring.iter().eq(model.iter()), "cap {cap}, after pushing {i}");
                    }
                }
            }
        }
    ''')),
    test_output=dedent("""
        $ cargo test ring
        running 2 tests
        test ring::tests::matches_vecdeque_model ... FAILED
        test ring::tests::wraps_in_order ... FAILED

        failures:

        ---- ring::tests::matches_vecdeque_model stdout ----
        thread 'ring::tests::matches_vecdeque_model' panicked at src/ring.rs:96:25:
        assertion `left == right` failed: cap 1, after pushing 0
          left: 0
         right: 1

        ---- ring::tests::wraps_in_order stdout ----
        thread 'ring::tests::wraps_in_order' panicked at src/ring.rs:81:17:
        assertion `left == right` failed
          left: [6, 3, 4]
         right: [3, 4, 5, 6]

        failures:
            ring::tests::matches_vecdeque_model
            ring::tests::wraps_in_order

        test result: FAILED. 0 passed; 2 failed; 0 ignored; 0 measured; 3 filtered out; finished in 0.00s
    """),
    commits=[
        "91b3d2e sink: MemorySink for crash reports",
        "3a0f7c8 ring: drain()",
        "c6e1d45 bench: push throughput",
    ],
)

# ------------------------------------------------------------------------------------------------ Rust: serde defaults
scenario(
    repo="fernhill/shipyard",
    lang="Rust",
    test_cmd="cargo test -p shipyard-config",
    title="Config files written for 0.11 fail to load in 0.12: missing field `timeout_ms`",
    issue=dedent("""
        After upgrading the `shipyard` CLI from 0.11.3 to 0.12.0, every project config that does not set the
        new `[deploy] timeout_ms` key fails to load:

        ```
        Error: failed to load shipyard.toml

        Caused by:
            missing field `timeout_ms` in `deploy` at line 7 column 1
        ```

        The 0.12 release notes say `timeout_ms` is optional with a default of 120000. The struct has
        `#[serde(default = "default_timeout")]` on... actually it doesn't; the default only exists in the
        `Default` impl of `DeployConfig`, which serde does not use unless the field or the struct is marked
        `#[serde(default)]`. The same applies to `retries` (new in 0.12 as well) and to `[healthcheck]`, which
        is a whole new optional table.

        Please make all fields added in 0.12 optional with the documented defaults, and consider adding a test
        that loads the 0.11 example config from `examples/` so this cannot happen again. It would also help if
        unknown keys produced a warning rather than being silently ignored: we had a typo (`timout_ms`) that
        went unnoticed because of this.

        shipyard 0.12.0 (installed with `cargo install`), rustc 1.78.
    """),
    tree=dedent("""
        shipyard/
        ├── Cargo.toml
        ├── crates/
        │   ├── shipyard-cli/
        │   │   └── src/main.rs
        │   └── shipyard-config/
        │       ├── Cargo.toml
        │       ├── src/
        │       │   ├── lib.rs
        │       │   ├── deploy.rs
        │       │   └── healthcheck.rs
        │       └── tests/
        │           └── compat.rs
        └── examples/
            ├── shipyard-0.11.toml
            └── shipyard-0.12.toml
    """),
    files=[
        ("crates/shipyard-config/src/deploy.rs", dedent('''
            use std::collections::BTreeMap;

            use serde::Deserialize;

            use crate::healthcheck::HealthcheckConfig;

            #[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
            #[serde(rename_all = "lowercase")]
            pub enum Strategy {
                Rolling,
                Recreate,
                BlueGreen,
            }

            #[derive(Debug, Clone, PartialEq, Deserialize)]
            pub struct DeployConfig {
                pub target: String,
                pub strategy: Strategy,
                #[serde(default)]
                pub env: BTreeMap<String, String>,
                /// How long to wait for a deployment to become healthy (new in 0.12).
                pub timeout_ms: u64,
                /// How many times to retry a failed rollout (new in 0.12).
                pub retries: u32,
                pub healthcheck: HealthcheckConfig,
            }

            impl Default for DeployConfig {
                fn default() -> Self {
                    DeployConfig {
                        target: String::new(),
                        strategy: Strategy::Rolling,
                        env: BTreeMap::new(),
                        timeout_ms: 120_000,
                        retries: 2,
                        healthcheck: HealthcheckConfig::default(),
                    }
                }
            }
        ''')),
        ("crates/shipyard-config/src/healthcheck.rs", dedent('''
            use serde::Deserialize;

            #[derive(Debug, Clone, PartialEq, Deserialize)]
            pub struct HealthcheckConfig {
                pub path: String,
                pub interval_ms: u64,
                pub healthy_threshold: u32,
            }

            impl Default for HealthcheckConfig {
                fn default() -> Self {
                    HealthcheckConfig { path: "/healthz".into(), interval_ms: 5_000, healthy_threshold: 3 }
                }
            }
        ''')),
        ("crates/shipyard-config/src/lib.rs", dedent('''
            mod deploy;
            mod healthcheck;

            use std::path::Path;

            use anyhow::{Context, Result};
            use serde::Deserialize;

            pub use deploy::{DeployConfig, Strategy};
            pub use healthcheck::HealthcheckConfig;

            #[derive(Debug, Clone, PartialEq, Deserialize)]
            pub struct ProjectConfig {
                pub name: String,
                #[serde(default)]
                pub description: Option<String>,
                pub deploy: DeployConfig,
            }

            pub fn load(path: &Path) -> Result<ProjectConfig> {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("failed to read {}", path.display()))?;
                parse(&text).with_context(|| format!("failed to load {}", path.display()))
            }

            pub fn parse(text: &str) -> Result<ProjectConfig> {
                Ok(toml::from_str(text)?)
            }
        ''')),
        ("examples/shipyard-0.11.toml", dedent('''
            name = "storefront"
            description = "Public web shop"

            [deploy]
            target = "k8s://prod-eu/storefront"
            strategy = "rolling"

            [deploy.env]
            RUST_LOG = "info"
            FEATURE_NEW_CART = "1"
        ''')),
    ],
    trace=dedent("""
        $ shipyard deploy --dry-run
        Error: failed to load shipyard.toml

        Caused by:
            TOML parse error at line 4, column 1
              |
            4 | [deploy]
              | ^^^^^^^^
            missing field `timeout_ms`

        $ shipyard --version
        shipyard 0.12.0 (3d41b7a 2024-05-28)
    """),
    test=("crates/shipyard-config/tests/compat.rs", dedent('''
        use shipyard_config::{parse, HealthcheckConfig, Strategy};

        #[test]
        fn loads_0_11_config_with_defaults() {
            let text = include_str!("../../../examples/shipyard-0.11.toml");
            let config = parse(text).expect("0.11 configs must keep loading");
            assert_eq!(config.deploy.strategy, Strategy::Rolling);
            assert_eq!(config.deploy.timeout_ms, 120_000);
            assert_eq!(config.deploy.retries, 2);
            assert_eq!(config.deploy.healthcheck, HealthcheckConfig::default());
        }

        #[test]
        fn partial_healthcheck_table() {
            let text = "name = \\"x\\"\\n[deploy]\\ntarget = \\"t\\"\\nstrategy = \\"recreate\\"\\n[deploy.healthcheck]\\npath = \\"/ready\\"\\n";
            let config = parse(text).unwrap();
            assert_eq!(config.deploy.healthcheck.path, "/ready");
            assert_eq!(config.deploy.healthcheck.interval_ms, 5_000);
        }
    ''')),
    test_output=dedent("""
        $ cargo test -p shipyard-config
             Running tests/compat.rs (target/debug/deps/compat-5b1f0e7d3c2a9e44)

        running 2 tests
        test partial_healthcheck_table ... FAILED
        test loads_0_11_config_with_defaults ... FAILED

        failures:

        ---- loads_0_11_config_with_defaults stdout ----
        thread 'loads_0_11_config_with_defaults' panicked at crates/shipyard-config/tests/compat.rs:6:30:
        0.11 configs must keep loading: TOML parse error at line 4, column 1
          |
        4 | [deploy]
          | ^^^^^^^^
        missing field `timeout_ms`

        ---- partial_healthcheck_table stdout ----
        thread 'partial_healthcheck_table' panicked at crates/shipyard-config/tests/compat.rs:16:30:
        called `Result::unwrap()` on an `Err` value: TOML parse error at line 2, column 1
          |
        2 | [deploy]
          | ^^^^^^^^
        missing field `timeout_ms`

        test result: FAILED. 0 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s
    """),
    commits=[
        "3d41b7a Release 0.12.0",
        "e7a9c20 config: deploy timeout, retries and healthcheck",
        "58b1f0d cli: --dry-run for deploy",
    ],
)

# ------------------------------------------------------------------------------------------------ Rust: chunking
scenario(
    repo="driftwood-io/blobsync",
    lang="Rust",
    test_cmd="cargo test chunk",
    title="Uploaded files lose their last bytes when the size is not a multiple of the chunk size",
    issue=dedent("""
        We noticed corrupted uploads with blobsync 1.3: the remote object is shorter than the local file, and
        the checksum check at the end does not catch it, because the checksum is computed over the same
        chunks that were uploaded.

        A 10,000,001-byte file uploaded with the default 4 MiB chunk size ends up as 8,388,608 bytes on the
        server (exactly two chunks). Files smaller than one chunk upload as **zero** bytes, which is how we
        noticed: our 300 KB config bundles were empty.

        I traced it to `ChunkReader`, which was rewritten in 1.3 to use `chunks_exact` over a memory-mapped
        file "to avoid bounds checks". `chunks_exact` never yields the final partial chunk; it has to be fetched
        with `.remainder()`. The manifest's `total_size` is computed from the chunks as well, so it is wrong
        too.

        Expected: every byte is uploaded; the manifest has the real size; and ideally the final verification
        compares the local file's size and hash (computed independently of the chunker) with the remote ones.

        blobsync 1.3.0 on Linux x86_64; 1.2.4 works correctly.
    """),
    tree=dedent("""
        blobsync/
        ├── Cargo.toml
        └── src/
            ├── main.rs
            ├── chunk.rs
            ├── manifest.rs
            ├── upload.rs
            └── verify.rs
    """),
    files=[
        ("src/chunk.rs", dedent('''
            use std::fs::File;
            use std::io;
            use std::path::Path;

            use memmap2::Mmap;
            use sha2::{Digest, Sha256};

            pub const DEFAULT_CHUNK_SIZE: usize = 4 * 1024 * 1024;

            #[derive(Debug, Clone, PartialEq, Eq)]
            pub struct Chunk {
                pub index: usize,
                pub offset: u64,
                pub len: usize,
                pub sha256: [u8; 32],
            }

            pub struct ChunkReader {
                map: Mmap,
                chunk_size: usize,
            }

            impl ChunkReader {
                pub fn open(path: &Path, chunk_size: usize) -> io::Result<Self> {
                    assert!(chunk_size > 0);
                    let file = File::open(path)?;
                    // SAFETY: the file is opened read-only and we do not expect it to change during upload.
                    let map = unsafe { Mmap::map(&file)? };
                    Ok(ChunkReader { map, chunk_size })
                }

                /// The chunks of the file, in order, with their data.
                pub fn chunks(&self) -> impl Iterator<Item = (Chunk, &[u8])> + '_ {
                    self.map.chunks_exact(self.chunk_size).enumerate().map(move |(index, data)| {
                        let chunk = Chunk {
                            index,
                            offset: (index * self.chunk_size) as u64,
                            len: data.len(),
                            sha256: Sha256::digest(data).into(),
                        };
                        (chunk, data)
                    })
                }
            }
        ''')),
        ("src/manifest.rs", dedent('''
            use serde::Serialize;
            use sha2::{Digest, Sha256};

            use crate::chunk::Chunk;

            #[derive(Debug, Serialize)]
            pub struct Manifest {
                pub name: String,
                pub total_size: u64,
                pub chunk_size: usize,
                pub chunks: Vec<String>,
                pub sha256: String,
            }

            impl Manifest {
                pub fn from_chunks(name: &str, chunk_size: usize, chunks: &[Chunk]) -> Self {
                    let mut whole = Sha256::new();
                    for chunk in chunks {
                        whole.update(chunk.sha256);
                    }
                    Manifest {
                        name: name.to_owned(),
                        total_size: chunks.iter().map(|c| c.len as u64).sum(),
                        chunk_size,
                        chunks: chunks.iter().map(|c| hex::encode(c.sha256)).collect(),
                        sha256: hex::encode(whole.finalize()),
                    }
                }
            }
        ''')),
        ("src/upload.rs", dedent('''
            use std::path::Path;

            use anyhow::{Context, Result};

            use crate::chunk::{Chunk, ChunkReader};
            use crate::manifest::Manifest;
            use crate::verify::verify_remote;

            pub struct Remote {
                pub client: reqwest::blocking::Client,
                pub base_url: String,
            }

            pub fn upload_file(remote: &Remote, path: &Path, name: &str, chunk_size: usize) -> Result<Manifest> {
                let reader = ChunkReader::open(path, chunk_size).with_context(|| format!("opening {}", path.display()))?;
                let mut uploaded: Vec<Chunk> = Vec::new();
                for (chunk, data) in reader.chunks() {
                    let url = format!("{}/objects/{}/chunks/{}", remote.base_url, name, chunk.index);
                    remote
                        .client
                        .put(&url)
                        .header("x-chunk-sha256", hex::encode(chunk.sha256))
                        .body(data.to_vec())
                        .send()?
                        .error_for_status()
                        .with_context(|| format!("uploading chunk {}", chunk.index))?;
                    uploaded.push(chunk);
                }
                let manifest = Manifest::from_chunks(name, chunk_size, &uploaded);
                let url = format!("{}/objects/{}/manifest", remote.base_url, name);
                remote.client.put(&url).json(&manifest).send()?.error_for_status()?;
                verify_remote(remote, &manifest)?;
                Ok(manifest)
            }
        ''')),
    ],
    trace=dedent("""
        $ head -c 10000001 /dev/urandom > /tmp/big.bin && blobsync push /tmp/big.bin --name big.bin
        uploaded big.bin: 2 chunks, 8388608 bytes, sha256 9f3e0c2a...d41b  [verified]
        $ stat -c %s /tmp/big.bin
        10000001
        $ printf 'hello' > /tmp/small.txt && blobsync push /tmp/small.txt --name small.txt
        uploaded small.txt: 0 chunks, 0 bytes, sha256 e3b0c442...b855  [verified]
    """),
    test=("src/chunk.rs (tests module)", dedent('''
        #[cfg(test)]
        mod tests {
            use super::*;
            use std::io::Write;

            fn reader_for(bytes: &[u8], chunk_size: usize) -> ChunkReader {
                let mut file = tempfile::NamedTempFile::new().unwrap();
                file.write_all(bytes).unwrap();
                ChunkReader::open(file.path(), chunk_size).unwrap()
            }

            #[test]
            fn chunk_covers_every_byte() {
                for (size, chunk_size) in [(0, 4), (3, 4), (4, 4), (9, 4), (10_001, 1_000)] {
                    let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
                    let reader = reader_for(&bytes, chunk_size);
                    let joined: Vec<u8> = reader.chunks().flat_map(|(_, data)| data.to_vec()).collect();
                    assert_eq!(joined, bytes, "size {size}, chunk size {chunk_size}");
                }
            }

            #[test]
            fn chunk_offsets_are_contiguous() {
                let reader = reader_for(&[7u8; 9], 4);
                let lens: Vec<(u64, usize)> = reader.chunks().map(|(c, _)| (c.offset, c.len)).collect();
                assert_eq!(lens, vec![(0, 4), (4, 4), (8, 1)]);
            }
        }
    ''')),
    test_output=dedent("""
        $ cargo test chunk
        running 2 tests
        test chunk::tests::chunk_offsets_are_contiguous ... FAILED
        test chunk::tests::chunk_covers_every_byte ... FAILED

        failures:

        ---- chunk::tests::chunk_offsets_are_contiguous stdout ----
        thread 'chunk::tests::chunk_offsets_are_contiguous' panicked at src/chunk.rs:71:9:
        assertion `left == right` failed
          left: [(0, 4), (4, 4)]
         right: [(0, 4), (4, 4), (8, 1)]

        ---- chunk::tests::chunk_covers_every_byte stdout ----
        thread 'chunk::tests::chunk_covers_every_byte' panicked at src/chunk.rs:63:17:
        assertion `left == right` failed: size 3, chunk size 4
          left: []
         right: [0, 1, 2]

        failures:
            chunk::tests::chunk_covers_every_byte
            chunk::tests::chunk_offsets_are_contiguous

        test result: FAILED. 0 passed; 2 failed; 0 ignored; 0 measured; 9 filtered out; finished in 0.01s
    """),
    commits=[
        "a81f3c6 Release 1.3.0",
        "5d0e2b9 chunk: mmap the file and use chunks_exact",
        "f44a7e1 verify: compare manifest hash with the server's",
    ],
)

# ------------------------------------------------------------------------------------------------ Rust: integer overflow
scenario(
    repo="petrel-net/httpq",
    lang="Rust",
    test_cmd="cargo test --lib parse",
    title="Oversized Content-Length panics in debug builds and wraps to a small value in release",
    issue=dedent("""
        Security-adjacent bug in the HTTP/1.1 request parser (found by our fuzzer, not exploited as far as we
        know):

        * Debug builds: a request with `Content-Length: 99999999999999999999` panics with
          `attempt to multiply with overflow` in `parse_decimal`.
        * Release builds: the same value wraps around (overflow checks are off), producing a small body length.
          The parser then reads that many bytes as the body and treats the rest of the payload as the *next*
          request on the connection. Behind a proxy that interprets the header correctly (rejects it, or
          treats it as huge), that is a request smuggling vector.

        There are two more issues in the same function: a leading `+` is accepted (`Content-Length: +5`), and
        duplicate `Content-Length` headers with different values are accepted, the last one winning. RFC 9112
        §6.3 says both must be rejected: an invalid Content-Length is an unrecoverable error, and differing
        duplicates must be treated as an error.

        Expected: `parse_decimal` uses checked arithmetic, and invalid values produce `ParseError::BadContentLength`
        (→ 400 Bad Request, connection closed). A body limit (`max_body_size`, default 10 MiB) should be checked
        before any allocation too: today we `Vec::with_capacity(len)` with the parsed value.
    """),
    tree=dedent("""
        httpq/
        ├── Cargo.toml
        ├── fuzz/fuzz_targets/request.rs
        └── src/
            ├── lib.rs
            ├── conn.rs
            ├── error.rs
            ├── headers.rs
            └── parse.rs
    """),
    files=[
        ("src/parse.rs", dedent('''
            use crate::error::ParseError;
            use crate::headers::Headers;

            #[derive(Debug, Clone, PartialEq, Eq)]
            pub struct RequestHead {
                pub method: String,
                pub target: String,
                pub headers: Headers,
                pub content_length: Option<usize>,
            }

            /// Parse an unsigned decimal number as used in Content-Length.
            fn parse_decimal(bytes: &[u8]) -> Result<usize, ParseError> {
                let digits = bytes.strip_prefix(b"+").unwrap_or(bytes);
                if digits.is_empty() {
                    return Err(ParseError::BadContentLength);
                }
                let mut value: usize = 0;
                for &b in digits {
                    if !b.is_ascii_digit() {
                        return Err(ParseError::BadContentLength);
                    }
                    value = value * 10 + (b - b'0') as usize;
                }
                Ok(value)
            }

            pub fn parse_head(buf: &[u8]) -> Result<Option<(RequestHead, usize)>, ParseError> {
                let Some(end) = find_head_end(buf) else { return Ok(None) };
                let text = std::str::from_utf8(&buf[..end]).map_err(|_| ParseError::NotUtf8)?;
                let mut lines = text.split("\\r\\n");
                let request_line = lines.next().ok_or(ParseError::BadRequestLine)?;
                let mut parts = request_line.splitn(3, ' ');
                let method = parts.next().filter(|m| !m.is_empty()).ok_or(ParseError::BadRequestLine)?;
                let target = parts.next().ok_or(ParseError::BadRequestLine)?;
                let version = parts.next().ok_or(ParseError::BadRequestLine)?;
                if version != "HTTP/1.1" && version != "HTTP/1.0" {
                    return Err(ParseError::UnsupportedVersion);
                }

                let mut headers = Headers::default();
                let mut content_length = None;
                for line in lines.take_while(|l| !l.is_empty()) {
                    let (name, value) = line.split_once(':').ok_or(ParseError::BadHeader)?;
                    let value = value.trim_matches(|c| c == ' ' || c == '\\t');
                    if name.eq_ignore_ascii_case("content-length") {
                        content_length = Some(parse_decimal(value.as_bytes())?);
                    }
                    headers.append(name, value);
                }
                let head = RequestHead { method: method.into(), target: target.into(), headers, content_length };
                Ok(Some((head, end + 4)))
            }

            fn find_head_end(buf: &[u8]) -> Option<usize> {
                buf.windows(4).position(|w| w == b"\\r\\n\\r\\n")
            }
        ''')),
        ("src/conn.rs", dedent('''
            use std::io::{self, Read, Write};

            use crate::error::ParseError;
            use crate::parse::{parse_head, RequestHead};

            pub struct Config {
                pub max_head_size: usize,
                pub max_body_size: usize,
            }

            pub fn read_request<S: Read + Write>(stream: &mut S, buf: &mut Vec<u8>, config: &Config)
                -> io::Result<Option<(RequestHead, Vec<u8>)>>
            {
                loop {
                    match parse_head(buf) {
                        Ok(Some((head, consumed))) => {
                            let len = head.content_length.unwrap_or(0);
                            let mut body = Vec::with_capacity(len);
                            let available = (buf.len() - consumed).min(len);
                            body.extend_from_slice(&buf[consumed..consumed + available]);
                            while body.len() < len {
                                let mut chunk = [0u8; 8192];
                                let n = stream.read(&mut chunk)?;
                                if n == 0 {
                                    return Err(io::ErrorKind::UnexpectedEof.into());
                                }
                                let take = n.min(len - body.len());
                                body.extend_from_slice(&chunk[..take]);
                                buf.extend_from_slice(&chunk[take..n]);
                            }
                            buf.drain(..consumed + available);
                            return Ok(Some((head, body)));
                        }
                        Ok(None) if buf.len() > config.max_head_size => {
                            stream.write_all(b"HTTP/1.1 431 Request Header Fields Too Large\\r\\n\\r\\n")?;
                            return Ok(None);
                        }
                        Ok(None) => {
                            let mut chunk = [0u8; 8192];
                            let n = stream.read(&mut chunk)?;
                            if n == 0 {
                                return Ok(None);
                            }
                            buf.extend_from_slice(&chunk[..n]);
                        }
                        Err(ParseError::BadContentLength) | Err(_) => {
                            stream.write_all(b"HTTP/1.1 400 Bad Request\\r\\nConnection: close\\r\\n\\r\\n")?;
                            return Ok(None);
                        }
                    }
                }
            }
        ''')),
    ],
    trace=dedent("""
        $ cargo +nightly fuzz run request -- -max_total_time=300
        ...
        thread '<unnamed>' panicked at src/parse.rs:23:17:
        attempt to multiply with overflow
        ==41823== ERROR: libFuzzer: deadly signal
        artifact_prefix='fuzz/artifacts/request/'; Test unit written to fuzz/artifacts/request/crash-3f0a9c1e
        Base64: UE9TVCAvIEhUVFAvMS4xDQpDb250ZW50LUxlbmd0aDogOTk5OTk5OTk5OTk5OTk5OTk5OTkNCg0K

        $ printf 'POST /a HTTP/1.1\\r\\nContent-Length: 18446744073709551621\\r\\n\\r\\nhelloGET /admin HTTP/1.1\\r\\n\\r\\n' | nc -q1 localhost 8080   # release build
        HTTP/1.1 200 OK      <- POST /a with body "hello"
        HTTP/1.1 200 OK      <- GET /admin, smuggled
    """),
    test=("src/parse.rs (tests module)", dedent('''
        #[cfg(test)]
        mod tests {
            use super::*;

            fn head(cl: &str) -> Result<Option<(RequestHead, usize)>, ParseError> {
                let raw = format!("POST / HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: {cl}\\r\\n\\r\\n");
                parse_head(raw.as_bytes())
            }

            #[test]
            fn parse_rejects_overflowing_content_length() {
                assert_eq!(head("99999999999999999999").unwrap_err(), ParseError::BadContentLength);
                assert_eq!(head("18446744073709551621").unwrap_err(), ParseError::BadContentLength);
            }

            #[test]
            fn parse_rejects_sign() {
                assert_eq!(head("+5").unwrap_err(), ParseError::BadContentLength);
            }

            #[test]
            fn parse_rejects_conflicting_duplicates() {
                let raw = b"POST / HTTP/1.1\\r\\nContent-Length: 5\\r\\nContent-Length: 6\\r\\n\\r\\n";
                assert_eq!(parse_head(raw).unwrap_err(), ParseError::BadContentLength);
            }

            #[test]
            fn parse_accepts_identical_duplicates() {
                let raw = b"POST / HTTP/1.1\\r\\nContent-Length: 5\\r\\nContent-Length: 5\\r\\n\\r\\n";
                assert_eq!(parse_head(raw).unwrap().unwrap().0.content_length, Some(5));
            }
        }
    ''')),
    test_output=dedent("""
        $ cargo test --lib parse
        running 4 tests
        test parse::tests::parse_accepts_identical_duplicates ... ok
        test parse::tests::parse_rejects_sign ... FAILED
        test parse::tests::parse_rejects_conflicting_duplicates ... FAILED
        test parse::tests::parse_rejects_overflowing_content_length ... FAILED

        failures:

        ---- parse::tests::parse_rejects_sign stdout ----
        thread 'parse::tests::parse_rejects_sign' panicked at src/parse.rs:81:41:
        called `Result::unwrap_err()` on an `Ok` value: Some((RequestHead { method: "POST", target: "/", headers: Headers([("Host", "x"), ("Content-Length", "+5")]), content_length: Some(5) }, 48))

        ---- parse::tests::parse_rejects_conflicting_duplicates stdout ----
        thread 'parse::tests::parse_rejects_conflicting_duplicates' panicked at src/parse.rs:87:40:
        called `Result::unwrap_err()` on an `Ok` value: Some((RequestHead { method: "POST", target: "/", headers: Headers([("Content-Length", "5"), ("Content-Length", "6")]), content_length: Some(6) }, 57))

        ---- parse::tests::parse_rejects_overflowing_content_length stdout ----
        thread 'parse::tests::parse_rejects_overflowing_content_length' panicked at src/parse.rs:23:17:
        attempt to multiply with overflow

        failures:
            parse::tests::parse_rejects_conflicting_duplicates
            parse::tests::parse_rejects_overflowing_content_length
            parse::tests::parse_rejects_sign

        test result: FAILED. 1 passed; 3 failed; 0 ignored; 0 measured; 12 filtered out; finished in 0.00s
    """),
    commits=[
        "c2e8a47 conn: keep pipelined bytes after the body in the buffer",
        "7b19f03 parse: accept HTTP/1.0",
        "19a5d6e fuzz: request target",
    ],
)

# ----------------------------------------------------------------------------------------------------------------
# Rendering: three framings of the same scenario
# ----------------------------------------------------------------------------------------------------------------

FENCE = {"Python": "python", "Go": "go", "TypeScript": "ts", "JavaScript": "js", "Rust": "rust"}
RUN_EXAMPLE = {
    "Python": "python reproduce.py",
    "Go": "go run ./scratch/repro",
    "TypeScript": "npx tsx repro.ts",
    "JavaScript": "node repro.js",
    "Rust": "cargo run --example repro",
}


def fence_for(path: str, lang: str) -> str:
    for suffix, name in ((".md", "markdown"), (".toml", "toml"), (".yaml", "yaml"), (".json", "json")):
        if path.endswith(suffix):
            return name
    return FENCE[lang]


def numbered(code: str) -> str:
    lines = code.split("\n")
    width = len(str(len(lines)))
    return "\n".join(f"{i:>{width}}:{line}" for i, line in enumerate(lines, 1))


def workdir(sc: dict) -> str:
    return "/repo" if sc["lang"] == "Python" else "/workspace/" + sc["repo"].split("/")[1]


def render_system(sc: dict, style: int) -> str:
    toolchain, _ = TOOLCHAINS[sc["lang"]]
    return SYSTEMS[style].format(
        repo=sc["repo"], workdir=workdir(sc), window=100, toolchain=toolchain, lang=sc["lang"],
        test_cmd=sc["test_cmd"], run_example=RUN_EXAMPLE[sc["lang"]],
    )


def frame_issue_with_files(sc: dict) -> str:
    """SWE-agent style: the issue, the layout and line-numbered files, then a shell prompt."""
    parts = [
        "We're currently solving the following issue within our repository. Here's the issue text:",
        f"ISSUE:\n{sc['title']}\n\n{sc['issue']}",
        dedent("""
            INSTRUCTIONS:
            Now you're going to solve this issue on your own, with the tools described above. Edit the files you
            need to, run anything you like, and when you are confident the issue is fixed, submit your changes.
            Note that the environment does NOT support interactive session commands. Reproduce the issue first:
            if it does not reproduce, find out why before changing code. Tests live next to the code they test.

            A teammate looked at this before you and left the repository layout and the files they suspect.
            Their notes may be incomplete or wrong.
        """),
        "Repository layout (truncated):\n" + sc["tree"],
    ]
    test_path, test_code = sc["test"]
    for path, code in [*sc["files"], (test_path, test_code)]:
        total = code.count("\n") + 1
        parts.append(f"[File: {workdir(sc)}/{path} ({total} lines total)]\n{numbered(code)}")
    last = sc["files"][0][0]
    parts.append(f"(Open file: {workdir(sc)}/{last})\n(Current directory: {workdir(sc)})\nbash-$")
    return "\n\n".join(parts)


def frame_uploaded(sc: dict) -> str:
    """OpenHands style: uploaded repository, issue description, error output and relevant files."""
    lang = sc["lang"]
    parts = [
        f"<uploaded_files>\n{workdir(sc)}\n</uploaded_files>",
        f"I've uploaded a {lang} code repository in the directory {workdir(sc)}. Consider the following issue "
        "description:",
        f"<issue_description>\n# {sc['title']}\n\n{sc['issue']}\n</issue_description>",
        dedent("""
            Can you help me implement the necessary changes to the repository so that the requirements in the
            <issue_description> are met? Any test changes the issue needs are mine to make, so focus on the
            non-test files. Keep the change as small as the fix allows.

            Follow these steps:
            1. Explore the repository to understand how the affected code is structured and called.
            2. Write a script that reproduces the problem and run it to confirm the failure.
            3. Edit the source code to fix the problem.
            4. Rerun your script and confirm the fix; think about edge cases and make sure the fix covers them.

            Here is the error output I captured:
        """),
        f"<error_output>\n{sc['trace']}\n</error_output>",
        "And the files I believe are involved:",
    ]
    for path, code in sc["files"]:
        parts.append(f'<file path="{path}">\n```{fence_for(path, lang)}\n{code}\n```\n</file>')
    test_path, test_code = sc["test"]
    parts.append(f"I also wrote a test for it, which currently fails (`{test_path}`):")
    parts.append(f"```{fence_for(test_path, lang)}\n{test_code}\n```")
    return "\n\n".join(parts)


def frame_ci(sc: dict) -> str:
    """Maintainer style: CI is red; commits, failing test output, the test, and the code under test."""
    lang = sc["lang"]
    test_path, test_code = sc["test"]
    summary = sc["issue"].split("\n\n")[0]
    parts = [
        f"CI on `main` of {sc['repo']} is red. We added a regression test for the bug tracked as "
        f"\"{sc['title']}\" and it fails, as expected. Now we need the fix. Recent history:",
        "```\n" + "\n".join(sc["commits"]) + "\n```",
        "From the report:\n\n> " + summary.replace("\n", "\n> "),
        "The failing job's output:",
        f"```\n{sc['test_output']}\n```",
        f"The new test (`{test_path}`):",
        f"```{fence_for(test_path, lang)}\n{test_code}\n```",
        "Repository layout:\n" + sc["tree"],
        "Code under test:",
    ]
    for path, code in sc["files"]:
        parts.append(f"`{path}`:\n```{fence_for(path, lang)}\n{code}\n```")
    parts.append(dedent(f"""
        Please fix the library code so that the test passes without weakening it, and run `{sc['test_cmd']}`
        plus the rest of the suite before you finish. If you think the test itself is wrong, explain why
        instead of changing it.
    """))
    return "\n\n".join(parts)


FRAMES = [frame_issue_with_files, frame_uploaded, frame_ci]


def build_rows() -> list[dict]:
    """Every scenario in every framing; scenario i in framing v uses agent scaffold (i + v) mod 3."""
    conversations = []
    for variant, frame in enumerate(FRAMES):
        for index, sc in enumerate(SCENARIOS):
            conversations.append([
                {"role": "system", "content": render_system(sc, (index + variant) % len(SYSTEMS))},
                {"role": "user", "content": frame(sc)},
            ])
    # Interleave (a fixed permutation) so that neighbouring rows come from different projects and framings.
    count = len(conversations)
    order = sorted(range(count), key=lambda i: (i * 37) % count)
    return [{"sample_id": f"swe-{number:04d}", "messages": conversations[i]} for number, i in enumerate(order, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL file to write")
    args = parser.parse_args()
    rows = build_rows()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    words = sorted(sum(len(m["content"].split()) for m in row["messages"]) for row in rows)
    print(f"wrote {len(rows)} rows to {args.out} (words per prompt: min {words[0]}, "
          f"median {words[len(words) // 2]}, max {words[-1]})")


if __name__ == "__main__":
    main()

"""The main job: stream prompts → pre-tokenize → /generate → shards, as one continuous stream.

One producer reads and tokenizes prompts of every dataset in turn (the datasets expected to run longest first)
and hands them, longest expected output first within a bounded window (`ordering.py`), to a bounded queue;
`concurrency` workers keep that many requests in flight across all servers, so the server's batch stays full
across dataset and shard boundaries until the very end. Results go to per-dataset shard buffers
that commit by count or age; each commit is folded into the dataset's ledger. Whatever is interrupted, only
committed outcomes count, and a restart skips their slots. A line whose sample id appeared on an earlier line
(found by the counting pass, `scan.py`) gets a `duplicate_sample_id` error of its own, whatever was committed
before a restart. When the client reports that no server was live for longer than the outage budget, the run stops
without writing anything off. A dataset with `mode: all-turns` puts conversations on the queue instead: a worker
regenerates one turn by turn (`conversation.py` decides, `_converse` renders, generates and decodes) and records
its row when it stops, so a conversation is committed whole or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any

import numpy as np

from ..metrics import RunnerMetrics
from ..progress import ProgressDisplay, Snapshot, ThroughputMeter
from ..render.pretokenize import PromptEncoder
from ..render.request_fit import ServerLimits
from ..render.tokenizer_info import TokenizerInfo
from ..source.duplicates import DuplicateIds
from ..source.length_key import CODES
from ..source.line_codes import LineCodes
from ..source.prompts import Prompt, RowError, belongs_to_worker, duplicate_error, id_hash
from ..source.reader import read_prompts, source_format
from ..source.row_size import LARGE_PROMPT_CHARS, RowBound, prompt_size
from ..source.scan import LineSet
from ..spec.config import RunnerConfig
from ..spec.resource import DatasetSpec, SamplingSpec
from ..stats.histograms import IntHistogram
from ..store.commit_index import DatasetIndex
from ..store.index_store import CHECKPOINT_EVERY, put_checkpoint, take_checkpoint
from ..store.lease import LeaseKeeper, LeaseLost
from ..store.ledger import RETRYABLE_REASONS, DatasetLedger, ShardContent, Slot
from ..store.shards import Fence, ShardBuffer, commit_shard, new_run_token, new_shard_id
from ..store.storage import Storage, StorageError
from .client import GenerateClient, PromptIds
from .conversation import Conversation, history_exact, read_answer, start
from .ordering import (
    Cell,
    KeyCheck,
    LongestFirst,
    ReadProgress,
    code_tokens,
    expected_tokens,
    plan_passes,
    probe_size,
    window_size,
)
from .results import Generation, ServersUnavailable
from .rows import build_conversation_row, build_turn, failure_record, finish_rows, pending_row, too_long_record
from .seeds import sample_seed
from .summary import DatasetSummary, RunSummary

logger = logging.getLogger(__name__)

READ_BATCH = 256
READ_BATCH_CHARS = 16 * 1024 * 1024
TOKENIZE_BATCH = 64
COMMIT_ATTEMPTS = 5
MAX_PARALLEL_COMMITS = 4


Request = tuple["DatasetState", Prompt, PromptIds, int]  # a slot to generate: the prompt, its ids, its sample index


def _take(items: Iterator[Prompt | RowError], count: int, chars: int) -> list[Prompt | RowError]:
    """Up to `count` rows, fewer once they hold `chars` characters of prompt text (each row is under the row
    bound), so a chunk of large rows costs what a chunk of small ones does."""
    taken: list[Prompt | RowError] = []
    for item in islice(items, count):
        taken.append(item)
        chars -= prompt_size(item) if isinstance(item, Prompt) else 0
        if chars <= 0:
            break
    return taken


def tokenize_batches(admitted: list[tuple[Prompt, list[int]]]) -> Iterator[list[tuple[Prompt, list[int]]]]:
    """Batches of up to TOKENIZE_BATCH small prompts, and each large one alone: a batch's tokenizer memory is at
    most one large prompt's (row_size.py), not TOKENIZE_BATCH of them."""
    small: list[tuple[Prompt, list[int]]] = []
    for item in admitted:
        if prompt_size(item[0]) > LARGE_PROMPT_CHARS:
            yield [item]
            continue
        small.append(item)
        if len(small) == TOKENIZE_BATCH:
            yield small
            small = []
    if small:
        yield small


def _for_turn(seeds: Callable[[int, int], int], turn: int) -> Callable[[int], int]:
    """The seed of each attempt at one turn, with the turn bound now (a lambda in the loop would see a later one)."""
    return lambda attempt: seeds(attempt, turn)


class CommitFailed(RuntimeError):
    """A shard could not be committed: the store stayed unavailable past its retry budget."""


# Before a dataset's own answers are seen: the seeds' mean output was ~0.13-0.14 of a 10,240 cap.
TYPICAL_OUTPUT_SHARE = 0.15
MIN_OBSERVED_ROWS = 32  # committed samples of a dataset before its own mean output length is trusted


@dataclass
class DatasetState:
    spec: DatasetSpec
    index: int  # position in spec.datasets, for error messages that name the field
    sampling: SamplingSpec
    ledger: DatasetLedger  # every committed outcome of the dataset (all workers'), kept current by each commit
    buffer: ShardBuffer
    slots: int  # this worker's slots: its lines of the source (counted by the scan) x samples
    duplicates: DuplicateIds = field(default_factory=DuplicateIds)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat template arguments for this dataset
    sampling_sources: dict[str, Any] = field(default_factory=dict)  # where each sampling value came from
    skipped: int = 0
    generated: int = 0
    completion_tokens: int = 0
    truncated: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    given_up_before: Counter[str] = field(default_factory=Counter)  # skipped slots an earlier run gave up
    lengths: IntHistogram = field(default_factory=IntHistogram)  # this run's completion lengths
    commits: DatasetIndex | None = None  # the ledger with the shards folded into it (checkpoints are written from it)
    owned: LineSet | None = None  # this worker's lines (None: every line), from the scan
    source_rows: int | None = None  # rows of the source, every worker's (None: not scanned)
    last_line: int | None = None  # the highest line the source yields (None: not scanned)
    worker_lines: np.ndarray | None = None  # a bool per line of 1..last_line: this worker's slots' (None: every)
    # The operator's measured trial: the lines of this candidate's sample, each with its position in the sample's
    # order; they are sent before any other line (source/stratified.py).
    first: dict[int, int] = field(default_factory=dict)
    length_codes: tuple[int, ...] | None = None  # this worker's valid rows per length code (the scan's)
    codes: str | None = None  # where each line's length code is kept (scan_cache.py), for the whole-job order
    _params: dict[str, Any] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.commits is None:
            self.commits = DatasetIndex(self.ledger)
        elif self.commits.ledger is not self.ledger:
            raise ValueError(f"{self.spec.name}: the index folds into another ledger than the state's")

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def params(self) -> dict[str, Any]:
        """The sampling_params of the dataset's requests, built once (each request adds its seed to a copy)."""
        if self._params is None:
            self._params = self.sampling.to_sglang()
        return self._params

    @property
    def samples(self) -> int:
        """Samples per prompt: slots (line, 0..samples-1) of each line."""
        return self.spec.samples

    @property
    def done(self) -> int:
        return self.skipped + self.generated + sum(self.failed.values())

    def mean_output_expected(self) -> float:
        """Mean output length observed in what is committed (every worker's, kept current), else a share of the
        cap."""
        if self.ledger.completed >= MIN_OBSERVED_ROWS:
            return self.ledger.completion_tokens / self.ledger.completed
        return TYPICAL_OUTPUT_SHARE * (self.sampling.max_new_tokens or 0)


def open_slots(state: DatasetState, line: int, retry_failed: bool) -> list[int]:
    """The sample indices of the line still to settle (all of them for a new line)."""
    return [index for index in range(state.samples) if not state.ledger.is_done(Slot(line, index), retry_failed)]


def count_skipped(state: DatasetState, line: int, indices: Iterable[int]) -> None:
    """Settled slots met by this run: skipped, and noted when an earlier run gave them up."""
    state.skipped += _tally_skipped(state.ledger, line, indices, state.given_up_before)


def _tally_skipped(ledger: DatasetLedger, line: int, indices: Iterable[int], given_up: Counter[str]) -> int:
    """The settled slots of `indices` of the line, each given-up one's reason added to `given_up`."""
    count = 0
    for index in indices:
        count += 1
        slot = Slot(line, index)
        if ledger.is_given_up(slot):
            given_up[ledger.outcome(slot) or ""] += 1
    return count


class SettledTally:
    """The settled lines the reader skips, counted in the reader's thread as it meets them and handed to the loop
    in totals: a count and the given-up reasons, never a line each, so a resume past millions of settled lines
    holds nothing per line. One reading thread at a time writes the count (the loop awaits each chunk), and the
    loop moves what grew since it last looked; the reasons of given-up slots (rare) go through a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._skipped = 0  # grows in the reading thread
        self._moved = 0  # what the loop has counted of it
        self._given_up: Counter[str] = Counter()

    def add_rows(self, samples: int) -> None:
        """A line whose every slot has a row (the common case: no failure to look up)."""
        self._skipped += samples

    def add(self, ledger: DatasetLedger, line: int, samples: int) -> None:
        with self._lock:
            count = _tally_skipped(ledger, line, range(samples), self._given_up)
        self._skipped += count

    def move_to(self, state: DatasetState) -> None:
        """Add what was counted since the last move to the state's counts (on the loop)."""
        skipped = self._skipped
        with self._lock:
            given_up, self._given_up = self._given_up, Counter()
        state.skipped += skipped - self._moved
        self._moved = skipped
        state.given_up_before.update(given_up)


def summarize(state: DatasetState) -> DatasetSummary:
    lengths = state.lengths
    given_up = state.given_up_before + Counter({r: n for r, n in state.failed.items() if r in RETRYABLE_REASONS})
    return DatasetSummary(
        name=state.name, slots=state.slots, skipped=state.skipped, generated=state.generated,
        failed=dict(state.failed), completion_tokens=state.completion_tokens, truncated=state.truncated,
        median_completion=lengths.median(), mean_completion=lengths.mean(), max_completion=lengths.max,
        given_up=dict(given_up), completed=state.ledger.completed, source_rows=state.source_rows,
        missing=missing_slots(state),
    )


def missing_slots(state: DatasetState) -> int | None:
    """This worker's slots without a final outcome, by the same `completeness` the report and the operator judge
    the layout with (None: the source was not scanned, the count of slots met stands)."""
    if state.last_line is None:
        return None
    return state.ledger.completeness(state.last_line, state.samples, state.worker_lines).missing


class Runner:
    """Runs the stream for prepared datasets; setup (tokenizer, servers, ledger) happens in `prepare`."""

    def __init__(self, config: RunnerConfig, storage: Storage, encoder: PromptEncoder, info: TokenizerInfo,
                 client: GenerateClient, states: list[DatasetState], context_length: int, concurrency: int,
                 metrics: RunnerMetrics | None = None, display: ProgressDisplay | None = None,
                 clock: Callable[[], float] = time.monotonic, limits: ServerLimits | None = None,
                 send_seed: bool = True, lease: LeaseKeeper | None = None,
                 row_bound: RowBound | None = None, run_token: str | None = None) -> None:
        self.config = config
        self.send_seed = send_seed  # the servers' release accepts sampling_seed (every supported one does)
        self.lease = lease  # renewed while the run lasts; lost when another owner takes the output over
        self.storage = storage
        self.encoder = encoder
        self.info = info
        self.client = client
        self.states = states
        self.context_length = context_length
        self.limits = limits or ServerLimits(context_length)
        self.row_bound = row_bound or RowBound(context_length)
        self.concurrency = concurrency
        self.metrics = metrics or RunnerMetrics.create(config.name, config.namespace, config.worker_index)
        self.display = display or ProgressDisplay(log_every_s=config.progress_log_s)
        self.clock = clock
        self.meter = ThroughputMeter()
        self.in_flight = 0
        self.metrics.count_in_flight(lambda: self.in_flight)  # read when scraped, not set per request
        self._run_token = run_token or new_run_token()  # the lease records it: shard names of this run
        self._fence = None if lease is None else lease.commit_fence  # store/ownership.py
        self._sequence = 0
        self._commits: set[asyncio.Task[None]] = set()
        self._commit_slots = asyncio.Semaphore(MAX_PARALLEL_COMMITS)
        self._settled = SettledTally()  # lines the reader skipped as settled, counted in its thread
        self._key_check: KeyCheck | None = None  # the probe of the length key (ordering.py)
        self._stop = asyncio.Event()
        self._interrupted = False
        self._fatal: BaseException | None = None
        self._started = clock()

    # -- control -------------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Graceful stop (SIGTERM): commit what is finished, drop what is in flight (regenerated on resume)."""
        logger.warning("stop requested: committing finished samples; in-flight requests will be redone on resume")
        self._interrupted = True
        self._stop.set()

    def _fail(self, error: BaseException) -> None:
        if self._fatal is None:
            self._fatal = error
        self._stop.set()

    async def run(self, keep_lease: bool = False) -> RunSummary:
        """Generate until every open slot is settled, the run is stopped, or it fails; the output's lease is given
        up (a process) or left to go stale (a Job's worker) when it ends, unless `keep_lease`: a pass that commits
        after the stream (the hidden states) goes on under the same lease and fence and through the same client
        (its replicas' health, retries and outage clock), then closes the client and calls release_lease()."""
        try:
            summary = await self._run()
        except BaseException:
            await self.client.aclose()
            self.release_lease()
            raise
        if not keep_lease:
            await self.client.aclose()
            self.release_lease()
        return summary

    @property
    def fence(self) -> Fence | None:
        """What every commit record of this run proves before it is written (None without a lease)."""
        return self._fence

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.close()

    def confirm_lease(self) -> None:
        """Before exit 0 or a report: prove the lease once more, after every record of this run landed (LeaseLost:
        a takeover sealed this run, and what it committed since counts for nobody)."""
        if self.lease is not None:
            self.lease.confirm()

    async def _run(self) -> RunSummary:
        queue: asyncio.Queue[Request] = asyncio.Queue(maxsize=self.concurrency)
        producer = asyncio.create_task(self._guard(self._produce(queue)))
        workers = [asyncio.create_task(self._guard(self._work(queue))) for _ in range(self.concurrency)]
        ticker = asyncio.create_task(self._tick())
        drained = asyncio.create_task(self._drain(producer, queue))
        stopped = asyncio.create_task(self._stop.wait())
        await asyncio.wait({drained, stopped}, return_when=asyncio.FIRST_COMPLETED)
        tasks = [producer, drained, stopped, ticker, *workers]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(self._fatal, LeaseLost):
            logger.error("not committing the remaining buffers: this run no longer holds the output's lease")
        elif isinstance(self._fatal, CommitFailed):
            logger.error("not committing the remaining buffers: the store is unavailable; their samples are "
                         "generated again on resume")
        else:
            await self._flush_all()
        self._publish_remaining()
        self.display.close(self.snapshot())
        unavailable = self._fatal if isinstance(self._fatal, ServersUnavailable) else None
        if self._fatal is not None and unavailable is None:
            raise self._fatal
        return RunSummary(
            output_uri=self.storage.root_uri, datasets=[summarize(s) for s in self.states],
            elapsed_s=self.clock() - self._started, retries=self.client.retries,
            interrupted=self._interrupted, concurrency=self.concurrency, context_length=self.context_length,
            servers_unavailable=None if unavailable is None else str(unavailable) or type(unavailable).__name__,
            workers=self.config.worker_count,
        )

    async def _guard(self, coroutine: Any) -> None:
        try:
            await coroutine
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - a failed producer or worker must stop the run, loudly
            self._fail(error)

    async def _drain(self, producer: asyncio.Task[None], queue: asyncio.Queue[Any]) -> None:
        await producer
        await queue.join()

    # -- producing -----------------------------------------------------------------------------------------
    async def _produce(self, queue: asyncio.Queue[Request]) -> None:
        """Tokenized requests to the workers: a trial candidate's sample first, in its order (it is read whole
        first: a sample interleaves the datasets); then the probe of the length key, in input order; then the
        rest longest expected output first over the whole job, pass by pass, through a bounded window, or in input
        order once the probe says the key is weak (`ordering.py`). The window holds the ids as 4-byte arrays, a
        third of a list's memory, one per prompt for all its samples (sent as they are: the request body takes
        them without a copy)."""

        async def send(held: Request) -> None:
            await queue.put(held)

        if any(state.first for state in self.states):
            sample = [held for state in self.states if state.first
                      async for held, _ in self._requests(state, first=True)]
            for held in sorted(sample, key=lambda held: (held[0].first[held[1].line], held[3])):
                await send(held)
        window: LongestFirst[Request] = LongestFirst(window_size(self.concurrency))
        reads = {state.index: ReadProgress() for state in self.states}
        check = self._key_check = self._probe(window.window)
        if check is not None:
            for state, quota in self._probe_quotas(check):
                progress = reads[state.index]
                async for held, expected in self._requests(state, lambda line, _: True, progress, quota):
                    check.sent((state.index, held[1].line, held[3]), expected)
                    await send(held)
                progress.probe_end = progress.position
            check.closed = True

        def weak() -> bool:
            return check is not None and check.weak is True

        for codes in self._passes(window.window):
            for state in self.states:
                progress = reads[state.index]
                progress.begin(codes.get(state.index, frozenset()))
                if progress.current:
                    async for held, expected in self._requests(state, progress.in_pass, progress, stop=weak):
                        if (released := window.push(held, expected)) is not None:
                            await send(released)
                if weak():
                    break
                progress.end()
            if weak():
                break
        if check is not None and check.weak:  # the rest in input order: the window's, then every line not read
            logger.info("the length key does not predict the lengths drawn (corr %.2f over %d probe samples): the "
                        "rest of the job goes in input order", check.rho or 0.0, len(check.pairs))
            window.in_arrival_order()
            for state in self.states:
                async for held, expected in self._requests(state, reads[state.index].unread):
                    if (released := window.push(held, expected)) is not None:
                        await send(released)
        while len(window):
            if weak():
                window.in_arrival_order()
            await send(window.pop())

    def _probe(self, window: int) -> KeyCheck | None:
        """The check of the length key, when the job is large enough for the order to matter."""
        open_slots = sum(missing if (missing := missing_slots(state)) is not None else state.slots
                         for state in self.states)
        return KeyCheck(size=probe_size(open_slots)) if open_slots > window and probe_size(open_slots) else None

    def _probe_quotas(self, check: KeyCheck) -> list[tuple[DatasetState, int]]:
        """Each dataset's share of the probe, by its slots (a slot at least)."""
        total = max(1, sum(state.slots for state in self.states))
        return [(state, max(1, check.size * state.slots // total)) for state in self.states if state.slots]

    def _passes(self, window: int) -> list[dict[int, frozenset[int]]]:
        """The passes over the sources (`ordering.plan_passes`), from each dataset's count of rows per length code
        (the counting pass's); a dataset without counts is read whole in the last pass."""
        cells: list[Cell] = []
        for state in self.states:
            counts = state.length_codes or (0,) * CODES
            typical = state.mean_output_expected()
            cells.extend(Cell(state.index, code, count * state.samples,
                              code_tokens(code, state.sampling.max_new_tokens or 0, typical))
                         for code, count in enumerate(counts))
        return plan_passes(cells, window)

    async def _requests(self, state: DatasetState, accepts: Callable[[int, int], bool] | None = None,
                        progress: ReadProgress | None = None, limit: int | None = None,
                        stop: Callable[[], bool] | None = None, first: bool = False,
                        ) -> AsyncIterator[tuple[Request, float]]:
        """The dataset's open slots in source order, with its prompt ids and the output length expected of it: of
        the trial sample's lines when `first`, else of the lines `accepts(line, length code)` takes (every line
        when None), `progress.position` following the last line looked at. Stops at a chunk's end once `limit`
        slots were yielded or `stop()` says so."""
        spec = state.spec
        fmt = source_format(spec.source, spec.format, self.config.spec.output.endpoint)
        codes = self._line_codes(state) if accepts is not None else None
        selects = None
        if accepts is not None:
            def selects(line: int) -> bool:
                if progress is not None:
                    progress.position = line
                return accepts(line, codes.code(line) if codes is not None else 0)
        rows = read_prompts(spec.source, fmt, self.config.spec.output.endpoint, spec.limit,
                            wanted=partial(self._wanted, state, first, selects=selects), layout=spec.row_layout(),
                            bound=self.row_bound)
        typical = state.mean_output_expected()
        max_new = state.sampling.max_new_tokens or 0
        yielded = 0

        def rows_now() -> int:
            """Rows of the next chunk: up to the limit; a concurrency's worth while the probe's verdict is out (a
            reading stops only at a chunk's end, so a weak key turns the order off within about a batch)."""
            count = READ_BATCH if limit is None else max(1, min(READ_BATCH, limit - yielded))
            check = self._key_check
            if stop is not None and check is not None and check.weak is None:
                count = min(count, max(1, self.concurrency))
            return count

        try:
            while chunk := await asyncio.to_thread(_take, rows, rows_now(), READ_BATCH_CHARS):
                self._count_settled_lines(state)
                admitted = self._admit(state, chunk)
                for batch in tokenize_batches(admitted):
                    if state.spec.mode == "all-turns":
                        batch = self._conversations(state, batch)
                    encoded = await asyncio.to_thread(self.encoder.encode_batch,
                                                      [self._first_turn(state, p) for p, _ in batch],
                                                      state.template_kwargs)
                    for (prompt, indices), ids in zip(batch, encoded, strict=True):
                        if checked := self._checked(state, prompt, ids, indices):
                            expected = expected_tokens(prompt.messages, len(checked), max_new, typical)
                            packed = PromptIds(array("i", checked))  # the prompt's slots share it
                            for index in indices:
                                yielded += 1
                                yield (state, prompt, packed, index), expected
                if (limit is not None and yielded >= limit) or (stop is not None and stop()):
                    break
        finally:  # a pass that stops early closes its reading now (cancelled mid-chunk, the reader thread ends it)
            with contextlib.suppress(ValueError):  # "generator already executing" in that thread
                close = getattr(rows, "close", None)
                if close is not None:
                    close()
                if codes is not None:
                    codes.close()
        self._count_settled_lines(state)

    def _line_codes(self, state: DatasetState) -> LineCodes | None:
        """The dataset's lines' length codes, read in line order (None: not kept; its lines count as code 0)."""
        if state.codes is None:
            return None
        try:
            return LineCodes(self.storage.open_read(state.codes))
        except StorageError as error:
            logger.warning("%s: the lines' length codes cannot be read (%s): the dataset is read in one pass",
                           state.name, error)
            return None

    def _conversations(self, state: DatasetState,
                       batch: list[tuple[Prompt, list[int]]]) -> list[tuple[Prompt, list[int]]]:
        """The rows that can be regenerated turn by turn; the others get their error record, one per open slot."""
        kept = []
        for prompt, indices in batch:
            started = start(prompt)
            if isinstance(started, RowError):
                self._record_errors(state, started, indices, self.clock())
            else:
                kept.append((prompt, indices))
        return kept

    @staticmethod
    def _first_turn(state: DatasetState, prompt: Prompt) -> Prompt:
        if state.spec.mode != "all-turns":
            return prompt
        conversation = start(prompt)
        assert isinstance(conversation, Conversation)  # rows that cannot start were dropped by _conversations
        return conversation.next_prompt()

    def _wanted(self, state: DatasetState, first: bool, line: int,
                selects: Callable[[int], bool] | None = None) -> bool:
        """Before a row is parsed, in the reader's thread: False for another worker's line, for a line of the other
        reading (the trial sample's, or not), for a line another pass reads (`selects`), and for a line whose slots
        are all settled (noted for the loop to count as skipped: nothing of the state changes here)."""
        if state.owned is not None and not state.owned.has(line):
            return False
        if (line in state.first) != first:
            return False
        if selects is not None and not selects(line):
            return False
        if state.ledger.has_rows(line, state.samples):
            self._settled.add_rows(state.samples)
            return False
        if open_slots(state, line, self.config.retry_failed_slots):
            return self.config.generates  # a later hidden-state pass leaves them open: they are the first pass's
        self._settled.add(state.ledger, line, state.samples)
        return False

    def _count_settled_lines(self, state: DatasetState) -> None:
        """Count, on the loop, the settled lines the reader skipped since the last chunk."""
        self._settled.move_to(state)

    def _admit(self, state: DatasetState, chunk: list[Prompt | RowError]) -> list[tuple[Prompt, list[int]]]:
        """Drop other workers' rows and the slots already settled; record bad rows and duplicate ids (one record
        per open slot: each slot has its own outcome); return the prompts to generate with their open slots."""
        admitted: list[tuple[Prompt, list[int]]] = []
        now = self.clock()
        for item in chunk:
            if not belongs_to_worker(item, self.config.worker_index, self.config.worker_count):
                continue
            indices = open_slots(state, item.line, self.config.retry_failed_slots)
            count_skipped(state, item.line, [i for i in range(state.samples) if i not in indices])
            if not indices:
                continue
            if isinstance(item, RowError):
                self._record_errors(state, item, indices, now)
                continue
            # Most sources repeat no id: then neither the id's hash nor the lookup is done on the loop.
            first = state.duplicates.first_of(item.line, id_hash(item.sample_id)) if state.duplicates else None
            if first is not None:
                self._record_errors(state, duplicate_error(item.line, item.sample_id, first), indices, now)
                continue
            admitted.append((item, indices))
        return admitted

    def _record_errors(self, state: DatasetState, error: RowError, indices: list[int], now: float) -> None:
        for index in indices:
            self._record_error(state, dataclasses.replace(error, sample_index=index).as_record(state.name), now)

    def _checked(self, state: DatasetState, prompt: Prompt, ids: list[int] | RowError,
                 indices: list[int]) -> list[int] | None:
        if isinstance(ids, RowError):
            self._record_errors(state, ids, indices, self.clock())
            return None
        why = self.limits.misfit(len(ids), state.sampling.max_new_tokens or 0)
        if why is not None:
            for index in indices:
                self._record_error(state, too_long_record(state.name, prompt, why, state.index, index), self.clock())
            return None
        return ids

    # -- generating ----------------------------------------------------------------------------------------
    async def _work(self, queue: asyncio.Queue[Request]) -> None:
        while True:
            state, prompt, ids, index = await queue.get()
            retry_round = self._retry_round(state, prompt.line, index)
            seeds = self._seeds(state, prompt.line, retry_round, index)
            params = state.params
            if state.spec.mode == "all-turns":
                try:
                    await self._converse(state, prompt, ids.ids.tolist(), params, index, seeds, retry_round)
                finally:
                    queue.task_done()
                continue
            result = await self._generate(state, ids, params, _for_turn(seeds, 0), (state.name, prompt.line))
            now = self.clock()
            if isinstance(result, Generation):
                self._record_row(state, prompt, ids.ids, result, now, index, seeds(result.attempts - 1, 0))
            else:
                self._record_error(state, failure_record(state.name, prompt, result, index, retry_round), now)
            queue.task_done()

    def _retry_round(self, state: DatasetState, line: int, index: int) -> int:
        """0 for a slot's first run; a given-up slot run again by --retry-failed is one round past the last it
        failed in, so every round draws seeds no earlier round used."""
        slot = Slot(line, index)
        if not (self.config.retry_failed_slots and state.ledger.is_given_up(slot)):
            return 0
        return state.ledger.retry_round(slot) + 1

    def _seeds(self, state: DatasetState, line: int, retry_round: int, index: int) -> Callable[[int, int], int]:
        """The slot's seed of each (attempt, turn) in its retry round, each hashed once (the request sends it, the
        row records it)."""
        base = self.config.spec.seed
        made: dict[tuple[int, int], int] = {}

        def seed(attempt: int, turn: int) -> int:
            if (attempt, turn) not in made:
                made[attempt, turn] = sample_seed(base, state.name, line, index, attempt, retry_round, turn)
            return made[attempt, turn]

        return seed

    async def _generate(self, state: DatasetState, ids: list[int] | PromptIds, params: dict[str, Any],
                        seed_for: Callable[[int], int], affinity: tuple[str, int] | None = None) -> Generation | Any:
        """One request; `affinity` names its prefix group (the dataset's line: every sample of the prompt and every
        turn of its conversations extend the same prompt), which the client keeps on the replica that caches it."""
        self.in_flight += 1
        try:
            result = await self.client.generate(ids, params, seed_for if self.send_seed else None, affinity)
        finally:
            self.in_flight -= 1
        if isinstance(result, Generation):
            self.metrics.answered(state.name, result.attempts, True, result.completion_tokens, result.latency_s)
        else:
            self.metrics.answered(state.name, result.attempts, False, 0, 0.0)
        return result

    async def _converse(self, state: DatasetState, prompt: Prompt, ids: list[int], params: dict[str, Any],
                        sample_index: int, seeds: Callable[[int, int], int], retry_round: int) -> None:
        """Regenerate one conversation turn by turn (mode all-turns) and record it whole: its row, or one error
        record when a request fails for good (nothing of it is kept then; the slot is one conversation). Each turn
        has its own seed (seeds.py), recorded with the turn; the row's `seed` is its first turn's."""
        conversation = start(prompt)
        assert isinstance(conversation, Conversation)
        turns: list[dict[str, Any]] = []
        max_new = state.sampling.max_new_tokens or 0
        while True:
            turn_number = len(turns)
            result = await self._generate(state, ids, params, _for_turn(seeds, turn_number),
                                          (state.name, prompt.line))
            if isinstance(result, Generation):  # tokens count turn by turn, the sample once when recorded
                self.meter.record(self.clock(), 0, result.completion_tokens)
            else:
                record = failure_record(state.name, prompt, result, sample_index, retry_round)
                record["message"] += f" (turn {len(turns)} of the conversation; it is generated again as a whole)"
                self._record_error(state, record, self.clock())
                return
            exact = None if not turns else history_exact(turns[-1]["prompt_ids"], turns[-1]["output_ids"], ids)
            turn = build_turn(state.name, prompt, ids, result, max_new, self.info, exact, None,
                              seeds(result.attempts - 1, turn_number))
            # Decoding a long output takes a while: off the loop, where every other request's bookkeeping runs.
            answer = await asyncio.to_thread(
                read_answer, result.output_ids, result.finish_reason, turn["reasoning_end"],
                turn["reasoning_end_token_id"] == self.info.tool_call_id, self.info.tool_call_id, self._decode)
            turn["tool_calls"] = json.dumps([{"name": c.name, "arguments": c.arguments, "id": c.id}
                                             for c in answer.calls], ensure_ascii=False) if answer.calls else None
            turns.append(turn)
            conversation.advance(answer, result.finish_reason)
            if conversation.done or not await self._next_turn(state, conversation):
                break
            ids = conversation.pending_ids
        row = build_conversation_row(state.name, prompt, turns, conversation.stop_reason or "complete",
                                     conversation.stop_detail, max_new, sample_index, turns[0]["seed"])
        self._record_conversation(state, row, [t["completion_tokens"] for t in turns])

    async def _next_turn(self, state: DatasetState, conversation: Conversation) -> bool:
        """Render the next turn's prompt into `conversation.pending_ids`; False (and the conversation stopped) when
        the template fails on the history or the prompt no longer fits."""
        encoded = await asyncio.to_thread(self.encoder.encode_one, conversation.next_prompt(), state.template_kwargs)
        if isinstance(encoded, RowError):  # a template that wants call arguments as text (see next_prompt)
            encoded = await asyncio.to_thread(self.encoder.encode_one, conversation.next_prompt(arguments_as_text=True),
                                              state.template_kwargs)
        if isinstance(encoded, RowError):
            conversation.stop("template_error", f"turn {conversation.turn}: {encoded.message}")
            return False
        why = self.limits.misfit(len(encoded), state.sampling.max_new_tokens or 0)
        if why is not None:
            conversation.stop("context_exceeded", f"turn {conversation.turn}: {why}")
            return False
        conversation.pending_ids = encoded
        return True

    def _decode(self, ids: Any, skip_special_tokens: bool) -> str:
        return self.encoder.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _record_conversation(self, state: DatasetState, row: dict[str, Any], lengths: list[int]) -> None:
        now = self.clock()
        if self._key_check is not None:
            self._key_check.back((state.index, row["line"], row["sample_index"]), row["completion_tokens"])
        state.buffer.add_row(row, now)
        state.generated += 1
        state.completion_tokens += row["completion_tokens"]
        state.truncated += row["stop_reason"] == "truncated"
        state.lengths.add_one(row["completion_tokens"])
        self.meter.record(now, 1, 0)
        if state.buffer.is_due(now):
            self._commit(state)

    def _record_row(self, state: DatasetState, prompt: Prompt, ids: Sequence[int], result: Generation,
                    now: float, index: int = 0, seed: int | None = None) -> None:
        max_new = state.sampling.max_new_tokens or 0
        if self._key_check is not None:
            self._key_check.back((state.index, prompt.line, index), result.completion_tokens)
        state.buffer.add_row(pending_row(state.name, prompt, ids, result, max_new, index, seed), now)
        state.generated += 1
        state.completion_tokens += result.completion_tokens
        state.truncated += result.finish_reason == "length"
        state.lengths.add_one(result.completion_tokens)
        self.meter.record(now, 1, result.completion_tokens)
        if state.buffer.is_due(now):
            self._commit(state)

    def _record_error(self, state: DatasetState, record: dict[str, Any], now: float) -> None:
        logger.warning("%s: %s", state.name, record["message"])
        if self._key_check is not None:
            self._key_check.back((state.index, record.get("line"), record.get("sample_index", 0)), None)
        state.buffer.add_error(record, now)
        state.failed[record["reason"]] += 1
        self.meter.record(now, 1, 0)
        if state.buffer.is_due(now):
            self._commit(state)

    # -- committing ----------------------------------------------------------------------------------------
    def _commit(self, state: DatasetState) -> None:
        content = state.buffer.take()
        self._sequence += 1
        shard_id = new_shard_id(self.config.worker_index, self._sequence, self._run_token)
        task = asyncio.create_task(self._write(state, shard_id, content))
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)

    async def _write(self, state: DatasetState, shard_id: str, content: ShardContent) -> None:
        dataset = state.name
        async with self._commit_slots:
            if self.lease is not None and self.lease.lost.is_set():
                self._fail(LeaseLost(f"not committing shard {dataset}/{shard_id}: {self.lease.why}"))
                return
            # The rows' fields read off their output ids, for the whole shard at once and off the loop (rows.py).
            await asyncio.to_thread(finish_rows, content.rows, self.info)
            for attempt in range(1, COMMIT_ATTEMPTS + 1):
                try:
                    marker = await asyncio.to_thread(
                        commit_shard, self.storage, dataset, shard_id, self.config.worker_index, content,
                        fence=self._fence,
                    )
                except LeaseLost as error:  # its data may be written: an unmarked leftover, never counted
                    self._fail(LeaseLost(f"not committing shard {dataset}/{shard_id}: {error}"))
                    return
                except StorageError as error:  # the store already retried for its whole budget
                    self._fail(CommitFailed(f"cannot commit shard {dataset}/{shard_id}: {error}"))
                    return
                except Exception as error:  # anything else (a local disk error): retried a few times, then fatal
                    if attempt == COMMIT_ATTEMPTS:
                        self._fail(CommitFailed(f"cannot commit shard {dataset}/{shard_id}: {error}"))
                        return
                    logger.warning("commit of %s/%s failed (%s); retrying", dataset, shard_id, error)
                    await asyncio.sleep(2 ** attempt)
                    continue
                assert state.commits is not None
                state.commits.fold(shard_id, marker)
                await self._checkpoint(state)
                logger.debug("committed %s/%s: %d rows, %d errors", dataset, shard_id,
                             len(content.rows), len(content.errors))
                self.metrics.committed(dataset, len(content.rows), [e["reason"] for e in content.errors])
                return

    async def _checkpoint(self, state: DatasetState, at_end: bool = False) -> None:
        """A single worker's index holds every commit of the dataset: checkpoint it now and then, and at the end,
        so a resume reads one object plus the markers since (with several workers the operator checkpoints)."""
        index = state.commits
        due = index is not None and index.since_checkpoint >= (1 if at_end else CHECKPOINT_EVERY)
        if self.config.worker_count != 1 or not due or index is None:
            return
        taken = take_checkpoint(index, self._run_token)  # on the loop: no fold lands half-way
        try:
            await asyncio.to_thread(put_checkpoint, self.storage, index.name, taken, b"", self._fence)
        except (StorageError, LeaseLost) as error:  # a missing checkpoint costs the next reader time, never correctness
            logger.warning("%s: could not write a checkpoint: %s", state.name, error)

    async def _flush_all(self) -> None:
        for state in self.states:
            if len(state.buffer):
                self._commit(state)
        while self._commits:
            await asyncio.gather(*list(self._commits), return_exceptions=True)
        for state in self.states:
            await self._checkpoint(state, at_end=True)

    async def _tick(self, every_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(every_s)
            now = self.clock()
            for state in self.states:
                if state.buffer.is_due(now):
                    self._commit(state)
            self._publish_remaining()
            self.display.show(self.snapshot(), now)

    def _publish_remaining(self) -> None:
        for state in self.states:
            self.metrics.set_remaining(state.name, state.slots - state.done)

    def snapshot(self) -> Snapshot:
        now = self.clock()
        samples_per_s, tokens_per_s = self.meter.rates(now, self._started)
        return Snapshot(
            done=sum(s.done for s in self.states), total=sum(s.slots for s in self.states),
            failed=sum(sum(s.failed.values()) for s in self.states), samples_per_s=samples_per_s,
            tokens_per_s=tokens_per_s, in_flight=self.in_flight, elapsed_s=now - self._started,
            tokens_left=sum(max(s.slots - s.done, 0) * s.mean_output_expected() for s in self.states),
        )

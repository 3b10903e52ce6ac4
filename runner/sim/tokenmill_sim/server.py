"""The HTTP edge: SGLang's endpoints on aiohttp, over the pure output generator and capacity model.

Endpoints: POST/PUT /generate, GET /health and /health_generate, /model_info and /server_info (plus their
deprecated /get_* aliases), /metrics. Times reported in responses and metrics are simulated seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill_runner.facts.hidden_states import check_layer_ids, default_eagle3_layer_ids
from tokenmill_runner.facts.releases import release

from .capacity import CapacityModel, Job, LinearStepTime, SchedulerParams, StepTime
from .config import SimConfig
from .engine import Engine, QueueFull, SimClock
from .hidden_states import FINAL_LAYER_KEY, StateCapture, hidden_states_entries
from .loader import load_model
from .metrics import SchedulerSnapshot, SimMetrics
from .model import LoadedModel
from .protocol import (
    Accounting,
    ApiError,
    GenerateItem,
    GenerateRequest,
    ServerLimits,
    abort_error,
    admit,
    bad_request,
    parse_generate,
    reasoning_token_count,
    response_item,
)
from .radix import PrefixCache
from .tokens import Finished, OutputGenerator, with_nan

logger = logging.getLogger(__name__)

READY_LINE = "The server is fired up and ready to roll!"
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
KEEPALIVE_TIMEOUT_S = 5.0  # SGLANG_TIMEOUT_KEEP_ALIVE: idle pooled connections are closed after 5 s
MAX_BODY_BYTES = 512 * 1024 * 1024  # a batch of long prompts is large; SGLang's server sets no small limit
SHUTDOWN_TIMEOUT_S = 2.0
QUEUE_FULL = "The request queue is full."
FAULT_ABORT_MESSAGE = "Abort in running batch (tokenmill simulator fault injection)."
SIM_KEY: web.AppKey[Simulator] = web.AppKey("simulator")


@functools.lru_cache(maxsize=8)
def _cached_model(model_path: str, trust_remote_code: bool = False) -> LoadedModel:
    # Tests start many servers on one model; tokenizers are safe to share across threads for encode/decode.
    return load_model(model_path, trust_remote_code)


@dataclass
class _Outcome:
    item: GenerateItem
    finished: Finished
    job: Job
    aborted: bool
    hidden_states: bool = False
    logprob_start_len: int = -1


def _state_capture(config: SimConfig, model_config: dict[str, Any]) -> StateCapture | None:
    """--enable-return-aux-hidden-states as the model's config resolves it (facts/hidden_states.py); without it,
    --enable-return-hidden-states serves the final state (aux capture takes its place when both are on:
    0.5.23 layers/logits_processor.py:866-872)."""
    if not (config.enable_return_aux_hidden_states or config.enable_return_hidden_states):
        return None
    nested = model_config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else model_config
    layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    if not config.enable_return_aux_hidden_states:
        return StateCapture([FINAL_LAYER_KEY], hidden, config.chunked_prefill_size)
    if config.return_aux_hidden_state_layer_ids:
        layer_ids = [int(part) for part in config.return_aux_hidden_state_layer_ids.split(",")]
        check_layer_ids(layer_ids, layers)
    else:
        layer_ids = default_eagle3_layer_ids(layers)
    return StateCapture(layer_ids, hidden, config.chunked_prefill_size)


class Simulator:
    """State behind one app: the model, the engine, metrics and fault dice."""

    def __init__(self, config: SimConfig, step_time: StepTime | None = None) -> None:
        self.config = config
        self.release = release(config.sglang_version)
        self.model = _cached_model(config.model_path, config.trust_remote_code)
        self.context_length = config.context_length or self.model.files.context_length
        self.limits = ServerLimits(self.context_length, config.max_total_tokens, config.page_size)
        self.generator = OutputGenerator(self.model.vocab, self.model.bank, self.model.encode, self.model.decode,
                                         config.seed, config.profile, self.release.eos_at_cap)
        self.scheduler = SchedulerParams(config.max_running_requests, config.max_total_tokens)
        # The step time from the flags, unless a model of the GPU and the model is given (capacity.StepTime).
        self.step_time = step_time or LinearStepTime(config.step_ms, config.step_ms_per_request,
                                                     config.prefill_ms_per_1k_tokens)
        self.engine: Engine | None = None
        self.state_capture = _state_capture(config, self.model.files.config)
        self.metrics = SimMetrics(config.model_name, self.snapshot, self.release)
        # Faults are drawn per request from one stream, not per prompt: a retry of a failed prompt can succeed.
        self.fault_rng = random.Random(config.seed ^ 0xFA17)
        self.in_flight: set[str] = set()
        self.started_at = time.monotonic()
        # What a poison prompt does (fault_crash_text): the standalone server's process dies; SimServer kills itself.
        self.crash: Callable[[], None] = lambda: os._exit(70)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def on_startup(self, app: web.Application) -> None:
        model = CapacityModel(self.scheduler, self.step_time, PrefixCache(self.config.max_total_tokens))
        self.engine = Engine(model, SimClock(self.config.time_scale), self.config.max_queued_requests)
        self.engine.start()
        self.started_at = time.monotonic()
        asyncio.get_running_loop().call_later(self.config.startup_seconds, logger.info, READY_LINE)

    async def on_cleanup(self, app: web.Application) -> None:
        if self.engine is not None:
            await self.engine.stop()

    def is_ready(self) -> bool:
        return time.monotonic() - self.started_at >= self.config.startup_seconds

    def _engine(self) -> Engine:
        assert self.engine is not None, "the app has not started"
        return self.engine

    def snapshot(self) -> SchedulerSnapshot:
        engine = self._engine()
        engine.sync()
        model = engine.model
        return SchedulerSnapshot(model.running, model.queued, model.decode_throughput(), model.used_tokens(),
                                 self.config.max_total_tokens, self.context_length, model.last_retracted,
                                 model.retracted_total)

    # ---- /generate ----------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as error:
            return _json(HTTPStatus.BAD_REQUEST, {"object": "error", "message": f"Invalid JSON body: {error}",
                                                  "type": "Bad Request", "param": None, "code": 400})
        try:
            parsed = parse_generate(body, self.release, self.context_length)
            self._claim_rids(parsed)
        except ApiError as error:
            return _json(error.status, error.body)
        try:
            hidden, start = self._hidden_state_request(body)
            return await self._serve(request, parsed, hidden, start)
        except ApiError as error:
            return _json(error.status, error.body)
        finally:
            self.in_flight.difference_update(item.rid for item in parsed.items)

    def _claim_rids(self, parsed: GenerateRequest) -> None:
        if any(item.rid in self.in_flight for item in parsed.items):
            raise bad_request("Duplicate request ID detected")
        self.in_flight.update(item.rid for item in parsed.items)

    def _unavailable_now(self) -> bool:
        start = self.config.fault_503_after_s
        if start is None:
            return False
        elapsed = time.monotonic() - self.started_at
        return start <= elapsed < start + self.config.fault_503_for_s

    def _poisoned(self, parsed: GenerateRequest) -> bool:
        text = self.config.fault_crash_text
        if not text:
            return False
        return any(text in self.model.decode(item.input_ids, False) for item in parsed.items)

    def _hidden_state_request(self, body: dict[str, Any]) -> tuple[bool, int]:
        """return_hidden_states against what the server allows (0.5.23 managers/tokenizer_manager.py:1394-1406)."""
        wanted = body.get("return_hidden_states", False)
        if wanted not in (True, False, "last"):
            raise bad_request("return_hidden_states must be a boolean or the string literal 'last'.")
        if wanted and self.state_capture is None:
            raise bad_request("The server is not configured to return hidden states. Please set "
                              "`--return-hidden-states-mode last`, `--return-hidden-states-mode full`, or "
                              "`--enable-return-hidden-states`.")
        if wanted == "last":
            raise bad_request("The tokenmill simulator serves return_hidden_states=True only.")
        start = body.get("logprob_start_len", -1) if body.get("return_logprob") else -1
        return bool(wanted), start if type(start) is int else -1

    async def _serve(self, request: web.Request, parsed: GenerateRequest, hidden: bool = False,
                     logprob_start_len: int = -1) -> web.StreamResponse:
        if self._poisoned(parsed):
            logger.error("a prompt contains the fault_crash_text: the server process dies")
            self.crash()
            await asyncio.sleep(3600)  # never answered: the connection is reset when the server goes down
        dice = [self.fault_rng.random() for _ in range(3)]
        if dice[0] < self.config.fault_503_rate or self._unavailable_now():
            self.metrics.observe_aborted()
            raise abort_error(HTTPStatus.SERVICE_UNAVAILABLE, QUEUE_FULL)
        outcomes = [dataclasses.replace(outcome, hidden_states=hidden, logprob_start_len=logprob_start_len)
                    for outcome in await self._run(parsed.items, logprob_start_len)]
        answers = [self._answer(outcome) for outcome in outcomes]
        if dice[1] < self.config.fault_reset_rate:
            return _drop_connection(request)  # generated and counted, but the answer is lost on the way
        if dice[2] < self.config.fault_slow_rate:
            await asyncio.sleep(self.config.fault_slow_seconds)
        return _json(HTTPStatus.OK, answers if parsed.batch else answers[0])

    async def _run(self, items: list[GenerateItem], logprob_start_len: int = -1) -> list[_Outcome]:
        engine = self._engine()
        outcomes: list[_Outcome] = []
        try:
            for item in items:
                max_new = admit(item, self.limits, self.release)
                if max_new != item.params.max_new_tokens:
                    item = dataclasses.replace(item, params=dataclasses.replace(item.params, max_new_tokens=max_new))
                finished, aborted = self._finish(item)
                job = Job(len(item.input_ids), len(finished.output_ids), 0.0, max_new_tokens=max_new,
                          prompt_ids=item.input_ids, output_ids=finished.output_ids,
                          match_limit=logprob_start_len if logprob_start_len >= 0 else None)
                try:
                    job = engine.submit(job)
                except QueueFull:
                    self.metrics.observe_aborted()
                    raise abort_error(HTTPStatus.SERVICE_UNAVAILABLE, QUEUE_FULL) from None
                outcomes.append(_Outcome(item, finished, job, aborted))
            await asyncio.gather(*(outcome.job.handle for outcome in outcomes))
        except BaseException:
            # The client went away (or the batch was refused): free the engine's slots like SGLang's abort.
            for outcome in outcomes:
                engine.cancel(outcome.job)
            raise
        return outcomes

    def _finish(self, item: GenerateItem) -> tuple[Finished, bool]:
        finished = self.generator.generate(item.input_ids, item.params)
        abort_draw, cut_draw, nan_draw = self.fault_rng.random(), self.fault_rng.random(), self.fault_rng.random()
        if nan_draw < self.config.fault_nan_rate and finished.output_ids:
            position = int(cut_draw * len(finished.output_ids))
            finished = with_nan(finished, position, item.params.max_new_tokens, self.model.vocab.eos,
                                self.model.vocab_size + 1, nan_first=self.release.eos_at_cap == "stop")
        if abort_draw >= self.config.fault_abort_rate:
            return finished, False
        kept = finished.output_ids[:int(len(finished.output_ids) * cut_draw)]
        reason = {"type": "abort", "message": FAULT_ABORT_MESSAGE, "status_code": None, "err_type": None}
        return Finished(kept, reason, None, finished.marks), True

    def _answer(self, outcome: _Outcome) -> dict[str, Any]:
        job, finished, item = outcome.job, outcome.finished, outcome.item
        assert job.finished_at is not None and job.admitted_at is not None and job.first_token_at is not None
        e2e = job.finished_at - job.arrival
        if outcome.aborted:
            self.metrics.observe_aborted()
        else:
            self.metrics.observe_finished(len(item.input_ids), len(finished.output_ids), e2e,
                                          job.first_token_at - job.arrival, job.admitted_at - job.arrival)
        text = self.generator.text(finished, item.params)
        reasoning = reasoning_token_count(item, finished.output_ids, self.model.vocab.think_end)
        accounting = Accounting(round(e2e, 6), reasoning, job.retractions, job.cached_tokens)
        answer = response_item(item, finished, text, accounting, self.release)
        if outcome.hidden_states and self.state_capture is not None:
            # A prefix served from the cache is not recomputed; logprob_start_len 0 caps the match at 0
            # (0.5.23 managers/schedule_batch.py:1766-1785).
            cached = 0 if outcome.logprob_start_len == 0 else job.cached_tokens
            finished_len = min(len(finished.output_ids), item.params.max_new_tokens)
            answer["meta_info"]["hidden_states"] = hidden_states_entries(
                self.state_capture, item.input_ids, finished.output_ids, cached, finished_len)
        echoed = answer.get("prompt_token_ids")
        rate = self.config.fault_input_mismatch_rate
        if echoed and rate and self.fault_rng.random() < rate:
            # What a proxy that decodes and re-encodes the prompt would leave: one id changed.
            echoed[-1] = (echoed[-1] + 1) % self.model.vocab_size
        return answer

    # ---- health and info ----------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.is_ready():
            return web.Response(status=HTTPStatus.SERVICE_UNAVAILABLE)
        engine = self._engine()
        engine.sync()
        if engine.model.running:
            return web.Response(status=HTTPStatus.OK)  # a busy server is producing output: healthy
        # Like SGLang's health request: one token through the scheduler, never refused for a full queue.
        job = engine.submit(Job(1, 1, 0.0), enforce_queue_limit=False)
        try:
            async with asyncio.timeout(HEALTH_CHECK_TIMEOUT_S):
                await asyncio.shield(job.handle)
        except TimeoutError:
            engine.cancel(job)
            return web.Response(status=HTTPStatus.SERVICE_UNAVAILABLE)
        except asyncio.CancelledError:  # the prober hung up
            engine.cancel(job)
            raise
        return web.Response(status=HTTPStatus.OK)

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(HTTPStatus.OK, {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.model.files.model_type,
            "architectures": self.model.files.architectures,
        })

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the served model's card (0.5.9 entrypoints/http_server.py:1421; 0.5.23
        entrypoints/http_server.py:1993; ModelCard: 0.5.9 entrypoints/openai/protocol.py:53, 0.5.23 :87), with
        max_model_len the context length the model runs with. smg asks it first when it registers a worker."""
        return _json(HTTPStatus.OK, {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": self.config.model_name, "parent": None, "max_model_len": self.context_length,
        }]})

    async def server_info(self, request: web.Request) -> web.Response:
        """/server_info as the release builds it (0.5.9 entrypoints/http_server.py:593-610; 0.5.23
        entrypoints/http_server.py:863): the ServerArgs fields, the scheduler's status, KV pool and longest input
        (0.5.9 managers/scheduler.py:3144), one internal state per data-parallel scheduler with its effective
        running slots (0.5.9 managers/scheduler.py:2650-2661), the version, and the keys later releases add."""
        snapshot = self.snapshot()
        args = self.server_args()
        info: dict[str, Any] = {
            **args,
            "status": "ready",
            "max_total_num_tokens": self.config.max_total_tokens,
            "max_req_input_len": self.limits.max_req_input_len,
            "internal_states": [{
                **args,
                "last_gen_throughput": snapshot.gen_throughput,
                "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": self.config.max_total_tokens,
                                 "graph": 0.0},
                "effective_max_running_requests_per_dp": self.config.max_running_requests,
            }],
            "version": self.release.version,
        }
        extras = {"startup_time": 0.0, "kv_events": None, "launch_command": "tokenmill sim-server",
                  "frontend": "python"}
        info.update({key: extras[key] for key in self.release.server_info_extra_keys})
        info["simulator"] = {key: value for key, value in asdict(self.config).items() if key != "api_key"}
        return _json(HTTPStatus.OK, info)

    def server_args(self) -> dict[str, Any]:
        """The ServerArgs fields the simulator models, under SGLang's names. context_length is what was passed
        (None unless given), as SGLang reports it."""
        config = self.config
        return {
            "model_path": config.model_path,
            "tokenizer_path": config.model_path,
            "served_model_name": config.model_name,
            "skip_tokenizer_init": False,
            "trust_remote_code": config.trust_remote_code,
            "context_length": config.context_length,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "mem_fraction_static": None,
            "max_running_requests": config.max_running_requests,
            "max_queued_requests": config.max_queued_requests,
            "max_total_tokens": config.max_total_tokens,
            "page_size": config.page_size,
            "chunked_prefill_size": config.chunked_prefill_size,
            "max_prefill_tokens": 16384,
            "schedule_policy": "fcfs",
            "kv_cache_dtype": "auto",
            "random_seed": config.seed,
            "enable_metrics": True,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "api_key_set": config.api_key is not None,
            "enable_return_hidden_states": config.enable_return_hidden_states,
            **({"enable_return_aux_hidden_states": config.enable_return_aux_hidden_states}
               if self.release.aux_hidden_states else {}),
        }

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.exposition())
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        response.charset = "utf-8"
        return response


def _json(status: int, payload: Any) -> web.Response:
    if isinstance(payload, str):  # an uncaught exception: Starlette's plain-text answer
        return web.Response(status=status, text=payload, content_type="text/plain")
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _drop_connection(request: web.Request) -> web.StreamResponse:
    """Close the socket without an answer, as a crashed server or a broken proxy would."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=HTTPStatus.INTERNAL_SERVER_ERROR)  # never reaches the client


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _auth_middleware(api_key: str) -> Middleware:
    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        # SGLang's API key middleware (0.5.9 utils/auth.py:149): /health* and /metrics stay open for probes and
        # scrapers; the scheme "Bearer" is matched without regard to case; anything else is 401 Unauthorized.
        open_path = request.path.startswith("/health") or request.path.startswith("/metrics")
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if request.method == "OPTIONS" or open_path or (scheme.lower() == "bearer" and key == api_key):
            return await handler(request)
        return _json(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized"})

    return authenticate


def build_app(config: SimConfig, step_time: StepTime | None = None) -> web.Application:
    """An aiohttp app serving SGLang's API from the simulator; loads the tokenizer now."""
    simulator = Simulator(config, step_time)
    middlewares = [_auth_middleware(config.api_key)] if config.api_key else []
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[SIM_KEY] = simulator
    app.on_startup.append(simulator.on_startup)
    app.on_cleanup.append(simulator.on_cleanup)
    app.router.add_route("POST", "/generate", simulator.generate)
    app.router.add_route("PUT", "/generate", simulator.generate)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, simulator.health)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, simulator.model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, simulator.server_info)
    app.router.add_get("/v1/models", simulator.models)
    app.router.add_get("/metrics", simulator.metrics_endpoint)
    return app


_SERVER_KWARGS: dict[str, Any] = {
    "keepalive_timeout": KEEPALIVE_TIMEOUT_S,
    "handler_cancellation": True,  # a client that hangs up frees its slots, as SGLang aborts disconnected requests
    "access_log": None,
}


class SimServer:
    """The simulator on a background thread with its own event loop; `with SimServer(config) as s: s.url`."""

    def __init__(self, config: SimConfig, host: str = "127.0.0.1", port: int = 0,
                 step_time: StepTime | None = None) -> None:
        self.config = config
        self.step_time = step_time
        self.host = host
        self.port = port
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> SimServer:
        app = build_app(self.config, self.step_time)  # in the caller's thread, so a bad model path raises here
        app[SIM_KEY].crash = lambda: threading.Thread(target=self.kill, name="tokenmill-sim-crash").start()
        self._thread = threading.Thread(target=self._main, args=(app,), name="tokenmill-sim-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise RuntimeError(f"the simulator failed to start: {self._error}") from self._error
        return self

    def _main(self, app: web.Application) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._listen(app))
        except BaseException as error:  # reported to start()'s caller
            self._error = error
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            assert self._runner is not None
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    async def _listen(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, shutdown_timeout=SHUTDOWN_TIMEOUT_S, **_SERVER_KWARGS)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._thread = None

    def kill(self) -> None:
        """Stop as a killed process does: every open connection is reset at once, nothing is answered, and the
        port refuses new connections."""
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return
        assert self._runner is not None
        server = self._runner.server

        def abort() -> None:
            for handler in list(getattr(server, "connections", [])):
                if handler.transport is not None:
                    handler.transport.abort()
            for site in list(self._runner.sites):  # type: ignore[union-attr]
                if site._server is not None:  # noqa: SLF001 - close the listening socket before any cleanup
                    site._server.close()  # noqa: SLF001
            self._loop.stop()  # type: ignore[union-attr]

        self._loop.call_soon_threadsafe(abort)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve(config: SimConfig, host: str, port: int) -> None:
    """Run the simulator in the foreground until SIGINT/SIGTERM."""
    app = build_app(config)
    logger.info("tokenmill simulator for %s on http://%s:%d (time scale %gx, %d slots)", config.model_path, host,
                port, config.time_scale, config.max_running_requests)
    web.run_app(app, host=host, port=port, backlog=4096, print=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                **_SERVER_KWARGS)

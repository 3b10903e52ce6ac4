"""Before the stream starts: tokenizer, servers, the ledger of what is committed, and the run's metadata.

Everything that can fail cheaply (a missing source, a wrong end-of-reasoning token, a server that never becomes
healthy) fails here, before a single request is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .facts.server_info import ServerFacts, client_options, runnable_requests, seeds_accepted
from .generate.client import GenerateClient, RetryPolicy, healthy_servers
from .generate.conversation import unread_call_format
from .generate.discovery import discover
from .generate.hidden_pass import refuse_unservable
from .generate.pipeline import TYPICAL_OUTPUT_SHARE, DatasetState, Runner
from .generate.replica_health import HealthPolicy
from .generate.sampling_defaults import apply_model_defaults, model_sampling_defaults
from .generate.seeds import seed_rule
from .metrics import RunnerMetrics
from .render.pretokenize import (
    PromptEncoder,
    describe_tokenizer,
    load_tokenizer,
    local_model_folder,
    model_family,
    model_generation_config,
)
from .render.request_fit import ServerLimits
from .render.tokenizer_info import TokenizerInfo
from .source.prompts import Prompt, RowError
from .source.reader import SourceError, describe_source, source_format
from .source.row_size import RowBound
from .source.scan_cache import cached_scan
from .source.stratified import SourceRows, first_lines
from .spec.config import RunnerConfig, TrialSample
from .spec.resource import MAX_CONCURRENCY, DatasetGenerationSpec, SpecError, content_hash
from .store.index_store import CHECKPOINT_EVERY, open_index, write_checkpoint
from .store.lease import LeaseHeld, LeaseKeeper, LeaseUnsupported, acquire, process_holder
from .store.lease_rules import CleanRule, LeaseError
from .store.ledger import LedgerBudget
from .store.manifest import (
    DatasetLayout,
    Owner,
    RunManifest,
    encode_lines,
    layout_changes,
    model_conflict,
    read_manifest,
    retire,
    write_manifest,
)
from .store.shards import ShardBuffer, clean_leftovers, new_run_token
from .store.storage import Storage, open_storage

logger = logging.getLogger(__name__)
# A typical request, for sizing concurrency before any output is seen (prompts 75-1130 tokens in the seeds; the
# output share is DatasetState's).
TYPICAL_PROMPT_TOKENS = 512


def resolve_context_length(config: RunnerConfig, server_info: dict[str, Any], info: TokenizerInfo) -> int:
    """The spec wins, then what the server reports, then the model's config.json."""
    configured = config.spec.server.context_length
    for value in (configured, server_info.get("context_length"), info.model_context_length):
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        "cannot tell the context length: set spec.server.contextLength (the server did not report one and the "
        "model's config.json has no max_position_embeddings)"
    )


def resolve_concurrency(config: RunnerConfig, servers: list[ServerFacts]) -> int:
    """Requests in flight for this worker. auto: what the servers can run at once (their running slots, or what
    their KV cache holds at a typical request length, whichever is smaller) plus half again as a queue, so SGLang
    never waits for the client; split over the workers."""
    configured = config.spec.runner.concurrency
    if isinstance(configured, int):
        return configured
    spec = config.spec
    longest_cap = max(spec.sampling_for(d).max_new_tokens or 0 for d in spec.datasets)
    typical_tokens = TYPICAL_PROMPT_TOKENS + TYPICAL_OUTPUT_SHARE * longest_cap
    total = int(runnable_requests(servers, len(config.servers), typical_tokens) * 1.5) + 64
    return max(16, min(MAX_CONCURRENCY, -(-total // config.worker_count)))


def prepare_states(config: RunnerConfig, storage: Storage, model_defaults: dict[str, Any] | None = None,
                   bound: RowBound | None = None, clean: CleanRule | None = None,
                   ) -> tuple[list[DatasetState], dict[str, DatasetLayout]]:
    """Scan the sources (rows, duplicate ids) and read the ledger before any request is sent (a missing file fails
    here, cheaply). `model_defaults` (from generation_config.json) fill the sampling fields the spec leaves unset.
    Returns the states and the layout each dataset has now (its rows, samples, source identity, input mapping).
    `clean` says which leftovers may be deleted (the lease's rule); None deletes none."""
    spec = config.spec
    states, layouts = [], {}
    counted: list[SourceRows] = []
    budget = LedgerBudget()  # the run's ledgers together (bounds.LEDGER_BYTES), whatever the output's markers say
    for index, dataset in enumerate(spec.datasets):
        fmt = source_format(dataset.source, dataset.format, spec.output.endpoint)
        try:
            scan = cached_scan(storage, dataset.name, dataset.source, fmt, spec.output.endpoint, dataset.limit,
                               config.worker_index, config.worker_count, dataset.row_layout(), bound)
        except SourceError as error:  # no retry reads it better: a spec error (exit 2), naming the dataset
            raise SpecError(f"spec.datasets[{index}] ({dataset.name}): {error}") from None
        sampling, sources = apply_model_defaults(spec.sampling_for(dataset), model_defaults or {})
        source = describe_source(dataset.source, spec.output.endpoint).model_copy(
            update={"content_hash": scan.content_hash})
        skipped = scan.skipped.mask(scan.lines) if scan.skipped is not None else None
        counted.append(SourceRows(dataset.name, scan.rows, skipped))
        try:  # the bounds every reader of run.json holds it to (bounds.MAX_SLOTS): refused before anything is written
            layouts[dataset.name] = DatasetLayout(
                rows=scan.rows, samples=dataset.samples, limit=dataset.limit, source=source,
                lines=scan.lines if skipped is not None else None,
                skipped=encode_lines(skipped) if skipped is not None else None,
                skipped_lines=int(skipped.sum()) if skipped is not None else 0,
                input=dataset.input.model_dump(mode="json", by_alias=True),
                chat_template_kwargs=spec.chat_template_kwargs_for(dataset), sampling=sources)
        except ValueError as error:
            raise SpecError(f"spec.datasets[{index}] ({dataset.name}): {error}") from None
        commits, caught = open_index(storage, dataset.name, scan.lines, dataset.samples, budget)
        extra = commits.ledger.rows_beyond(dataset.samples)
        if extra:
            logger.warning("%s: %d rows of sample indices %d and up were committed by a run with more samples per "
                           "prompt; they stay in the output (filter on sample_index to leave them out)",
                           dataset.name, extra, dataset.samples)
        logger.info("%s: %d markers folded (%d read now, %d listed)", dataset.name, commits.markers, caught.folded,
                    caught.listed)
        removed = 0 if clean is None else clean_leftovers(storage, dataset.name, config.worker_index, clean,
                                                          commits.knows, caught.strays)
        if removed:
            logger.info("%s: removed %d uncommitted leftover files of worker %d", dataset.name, removed,
                        config.worker_index)
        if config.worker_index == 0 and commits.since_checkpoint >= CHECKPOINT_EVERY:
            write_checkpoint(storage, commits, f"w{config.worker_index:03d}")
        states.append(DatasetState(
            spec=dataset, index=index, sampling=sampling, ledger=commits.ledger, commits=commits,
            duplicates=scan.duplicates, template_kwargs=spec.chat_template_kwargs_for(dataset),
            sampling_sources=sources, slots=scan.worker_rows * dataset.samples, owned=scan.owned,
            source_rows=scan.rows, last_line=scan.lines, worker_lines=scan.worker_lines(),
            buffer=ShardBuffer(spec.runner.shard_max_samples, spec.runner.shard_max_seconds),
            length_codes=scan.length_codes, codes=scan.codes,
        ))
    if config.trial_sample is not None:
        _take_trial_sample(config.trial_sample, states, counted)
    # Longest expected outputs first, so the run does not end on one long request with an idle GPU.
    states.sort(key=lambda state: -state.mean_output_expected())
    return states, layouts


def _take_trial_sample(sample: TrialSample, states: list[DatasetState], sources: list[SourceRows]) -> None:
    """The operator's measured trial: this candidate's rows go first (source/stratified.py)."""
    lines = first_lines(sample.seed, sample.candidate, sample.candidates, sample.prompts, sample.output_tokens,
                        sources)
    for state in states:
        state.first = lines[state.name]
    counts = ", ".join(f"{name} {len(found)}" for name, found in lines.items() if found)
    logger.info("trial sample of candidate %d of %d (seed %s): %d rows sent first (%s)", sample.candidate + 1,
                sample.candidates, sample.seed, sum(len(found) for found in lines.values()), counts or "none")


def spec_hash(spec: DatasetGenerationSpec) -> str:
    """The identity of a spec as `tokenmill run` records it (a runner Job records its Job's hash instead)."""
    return content_hash(spec.identity_document())


def run_owner(config: RunnerConfig) -> Owner:
    if config.owner_uid:
        return Owner(kind="DatasetGeneration", name=config.name, namespace=config.namespace or None,
                     uid=config.owner_uid)
    return Owner(kind="cli", name=config.name)


def run_manifest(config: RunnerConfig, info: TokenizerInfo, context_length: int | None,
                 layouts: dict[str, DatasetLayout], recorded: RunManifest | None = None,
                 send_seed: bool = True) -> RunManifest:
    from . import __version__

    try:  # the bounds every reader of run.json holds it to (bounds.py): the whole run's slots among them
        return RunManifest(
            tokenmill=__version__, owner=run_owner(config), spec_hash=config.job_hash or spec_hash(config.spec),
            name=config.name, started_at=datetime.now(UTC).isoformat(),
            spec=config.spec.model_dump(mode="json", by_alias=True), tokenizer=info.as_dict(),
            context_length=context_length, datasets=layouts, retired=retire(recorded, layouts),
            workers=config.worker_count,
            seeds={**seed_rule(config.spec.seed), "sent_as_sampling_seed": send_seed,
                   "deterministic_inference": config.spec.server.deterministic_inference},
        )
    except ValueError as error:
        raise SpecError(f"the run's layout: {error}") from None


def call_format_problem(encoder: PromptEncoder, template_kwargs: dict[str, Any], dataset: str,
                        family: str) -> str | None:
    """`conversation.unread_call_format` through the model's own template (mistral_common renders to ids: decoded)."""
    def render(prompt: Prompt) -> str | RowError:
        rendered = encoder.render(prompt, template_kwargs)
        return encoder.tokenizer.decode(rendered, skip_special_tokens=False) if isinstance(rendered, list) else rendered

    return unread_call_format(render, dataset, family)


def refuse_unread_call_formats(encoder: PromptEncoder, states: list[DatasetState], family: str) -> None:
    """Refuse `mode: all-turns` before any GPU hour when the model's template writes tool calls no parser reads."""
    for state in states:
        if state.spec.mode == "all-turns":
            why = call_format_problem(encoder, state.template_kwargs, state.name, family)
            if why is not None:
                raise SpecError(why)


def check_output(recorded: RunManifest | None, spec: DatasetGenerationSpec) -> None:
    """Refuse an output whose run.json records another model or tokenizer: two runs' outputs must never mix."""
    why = model_conflict(recorded, spec.model.path, spec.model.tokenizer or spec.model.path)
    if why:
        raise SpecError(f"{spec.output.uri}: {why}")


def check_layout(recorded: RunManifest | None, layouts: dict[str, DatasetLayout], states: list[DatasetState]) -> None:
    """Refuse a source or input mapping changed under committed work: the ledger is keyed by line, so committed
    outcomes would silently belong to other prompts."""
    committed = {state.name: state.ledger.settled for state in states}
    problems = layout_changes(recorded, layouts, committed)
    if problems:
        raise SpecError("; ".join(problems) + ". Put the original source back, or write the new one to another "
                        "output URI (a new run)")


async def prepare(config: RunnerConfig, api_key: str | None) -> Runner:
    spec = config.spec
    # Metrics first: tokenizer loading and the source count can take minutes, and an absent runner is alerted on.
    metrics = RunnerMetrics.create(config.name, config.namespace, config.worker_index)
    metrics.set_in_flight(0)
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.metrics_address)
    storage = open_storage(config.output_uri, spec.output.endpoint, spec.output.region)
    recorded = await asyncio.to_thread(read_manifest, storage)
    check_output(recorded, spec)
    token = new_run_token()
    try:
        lease = await asyncio.to_thread(acquire, storage, run_owner(config), process_holder(), token,
                                        config.take_over, spec.output.allow_unconditional_writes)
    except LeaseHeld as error:
        raise SpecError(f"{storage.root_uri}: {error}") from None
    except (LeaseUnsupported, LeaseError) as error:
        raise SpecError(str(error)) from None
    keeper = LeaseKeeper(storage, lease).start()
    try:
        return await _prepare(config, api_key, storage, recorded, metrics, keeper, token)
    except BaseException:
        keeper.close()
        raise


def _fenced(keeper: LeaseKeeper, write: Callable[..., object], *args: object) -> None:
    """A write of the output's one description (run.json) under the lease's fence: a worker 0 taken over while it
    was under way never replaces the taker's (store/ownership.py)."""
    with keeper.writing():
        write(*args)


async def _prepare(config: RunnerConfig, api_key: str | None, storage: Storage, recorded: RunManifest | None,
                   metrics: RunnerMetrics, keeper: LeaseKeeper, token: str) -> Runner:
    spec = config.spec
    tokenizer_location = spec.model.tokenizer or spec.model.path
    folder = await asyncio.to_thread(local_model_folder, tokenizer_location, spec.output.endpoint)
    refuse_unservable(spec, folder)
    tokenizer = await asyncio.to_thread(load_tokenizer, folder, spec.model.trust_remote_code)
    reasoning = spec.model.reasoning
    info = describe_tokenizer(tokenizer, tokenizer_location, reasoning.candidates(), spec.model.tool_call_token,
                              folder, explicit_end_tokens=reasoning.end_tokens is not None)
    model_defaults = model_sampling_defaults(model_generation_config(folder))
    # The row bound is known before the servers answer: the spec's context length, else the model's (an upper
    # bound of the server's is enough), so the scan and the stream refuse the same rows.
    context = spec.server.context_length
    bound = RowBound.of(None if context == "auto" else context, info.model_context_length)
    states, layouts = await asyncio.to_thread(prepare_states, config, storage, model_defaults, bound,
                                              keeper.clean_rule)
    check_layout(recorded, layouts, states)
    encoder = PromptEncoder(tokenizer)
    refuse_unread_call_formats(encoder, states, model_family(folder, tokenizer_location))
    if config.worker_index == 0:  # the layout is recorded before any shard of it is committed
        configured = spec.server.context_length
        early = configured if isinstance(configured, int) else info.model_context_length
        await asyncio.to_thread(_fenced, keeper, write_manifest, storage,
                                run_manifest(config, info, early, layouts, recorded))
    healthy = await healthy_servers(config.servers, config.server_wait_s, api_key)
    endpoints = await asyncio.gather(*(discover(url, api_key, config.server_wait_s) for url in healthy))
    facts = [endpoint.facts for endpoint in endpoints]
    context_length = resolve_context_length(config, endpoints[0].info, info)
    limits = ServerLimits.of(context_length, facts)
    concurrency = resolve_concurrency(config, facts)
    send_seed = seeds_accepted(facts)
    if not spec.server.deterministic_inference:
        logger.info("per-sample seeds are recorded and sent, but SGLang uses them only with "
                    "--enable-deterministic-inference (spec.server.deterministicInference): sampling is not "
                    "reproducible without it")
    if config.worker_index == 0:
        manifest = run_manifest(config, info, context_length, layouts, recorded, send_seed)
        await asyncio.to_thread(_fenced, keeper, write_manifest, storage, manifest)
    client = GenerateClient(
        config.servers, api_key=api_key, concurrency=concurrency,
        retry=RetryPolicy(max_attempts=spec.runner.max_attempts),
        health=HealthPolicy(probe_first_s=config.probe_first_s,
                            probe_max_s=max(config.probe_first_s, config.probe_max_s),
                            outage_budget_s=spec.runner.outage_budget_seconds),
        timeout_s=spec.runner.request_timeout_seconds, listener=metrics,
        initially_down=[url for url in config.servers if url not in healthy], vocab_size=info.vocab_size,
        probe_routes={endpoint.url: endpoint.probe_route for endpoint in endpoints},
        **client_options(facts, info.reasoning_end_id is not None),
    )
    logger.info("generating %s into %s: %d servers, concurrency %d, context length %d",
                ", ".join(s.name for s in states), storage.root_uri, len(config.servers), concurrency,
                context_length)
    return Runner(config, storage, encoder, info, client, states, context_length, concurrency,
                  metrics=metrics, limits=limits, send_seed=send_seed, lease=keeper, row_bound=bound,
                  run_token=token)

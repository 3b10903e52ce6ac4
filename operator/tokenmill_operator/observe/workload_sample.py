"""The job as its sources say it is, read at plan time: each dataset's rows counted (source/survey.py: exactly within
a bound, estimated from the bytes a row takes past it), and a sample of its rows spread over the source, rendered
with the model's chat template and tokenized, for its prompt lengths and (where rows carry the assistant turns being
regenerated) its earlier answers' lengths. The storage and tokenizer edge of facts/workload.py; the planner stays
pure.

Bounded everywhere: per source the survey's bytes, rows and seconds (SurveyBounds), for the whole spec a time budget
(`SurveyReader.seconds`) that later datasets share; every row passes the runner's row bound before it is parsed. A
dataset whose source cannot be read is counted as SAMPLES_ASSUMED rows of PROMPT_TOKENS_ESTIMATE tokens, and the
plan says why; nothing here fails the plan.

Who reads decides what may be read (`SurveyReader`): `tokenmill plan` reads local files and runs the tokenizer
(its remote code only with spec.model.trustRemoteCode); the operator reads only S3, with the tenant's credentials,
and never loads a tokenizer (a tenant's tokenizer is its code and its files, and the operator's memory and 64 MiB
/tmp serve every tenant): there prompt lengths are estimated from the sample's characters, and the context the job
needs from their UTF-8 bytes, which no byte-level or byte-fallback tokenizer exceeds in tokens.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from tokenmill_runner.facts.workload import LengthSample, Workload
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer, local_model_folder
from tokenmill_runner.source.length_key import earlier_answer_chars
from tokenmill_runner.source.prompts import Prompt
from tokenmill_runner.source.reader import SourceError, StoreOpener, source_format
from tokenmill_runner.source.row_size import RowBound
from tokenmill_runner.source.survey import SourceSurvey, SurveyBounds, survey_source
from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.storage import Storage, StorageError, StorageRetry, open_storage

from .tenant_store import TenantStorage

logger = logging.getLogger(__name__)

ENCODE_BATCH = 256
# Characters a token covers on average in English prose (code ~3, CJK ~1.5): the prompt-length estimate where no
# tokenizer is loaded. An estimate for the ETA only; the context length is sized from bytes instead (an upper bound).
CHARS_PER_TOKEN = 4.0
# Tokens a chat template adds per message (role markers, separators) over its text, for the byte bound.
TEMPLATE_TOKENS_PER_MESSAGE = 16
PLAN_SECONDS = 60.0  # every dataset of one spec together
# The operator's share: it plans in a reconcile pass that serves every tenant, once per spec generation (the plan is
# kept in status), so it reads less and for less long than `tokenmill plan` does.
OPERATOR_SECONDS = 20.0
OPERATOR_BOUNDS = SurveyBounds(max_bytes=16 * 1024 * 1024, sample_rows=1000, seconds=10.0)


@dataclass(frozen=True)
class SurveyReader:
    """How a plan may reach the sources and the tokenizer."""

    endpoint: str | None = None
    opener: StoreOpener | None = None  # the stores the sources are in (the operator's: the tenant's, bounded)
    local: bool = True  # local files too (tokenmill plan); the operator reads S3 only
    tokenize: bool = True  # load the model's tokenizer (tokenmill plan); the operator never does
    seconds: float = PLAN_SECONDS
    bounds: SurveyBounds = field(default_factory=SurveyBounds)
    retry: StorageRetry | None = None  # the tokenizer's reads (tokenmill plan's short budget)
    # What a user can do when a source cannot be read, appended to the why (tokenmill plan names its flags).
    hint: str = ""


def _prompt_part(prompt: Prompt) -> Prompt:
    """The prompt a request sends: the row's messages without the trailing assistant turns it regenerates."""
    messages = list(prompt.messages)
    while messages and messages[-1].get("role") == "assistant":
        messages.pop()
    return replace(prompt, messages=messages)


def _answer_text(messages: list[dict[str, Any]]) -> str:
    parts = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for key in ("content", "reasoning_content"):
            value = message.get(key)
            if isinstance(value, str):
                parts.append(value)
            elif isinstance(value, list):
                parts += [p.get("text") or "" for p in value if isinstance(p, dict)]
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                parts.append(str(function.get("arguments") or ""))
    return "\n".join(parts)


def _prompt_text(prompt: Prompt) -> str:
    return orjson.dumps([prompt.messages, prompt.tools]).decode()


def sample_lengths(encoder: PromptEncoder, tokenizer: Any, prompts: list[Prompt],
                   template_kwargs: dict[str, Any] | None = None, whole: bool = False) -> LengthSample:
    """Token counts of the prompts (as SGLang will see them) and of the earlier answers the rows carry."""
    counts: list[int] = []
    answers: list[int] = []
    for start in range(0, len(prompts), ENCODE_BATCH):
        batch = prompts[start:start + ENCODE_BATCH]
        for prompt, ids in zip(batch, encoder.encode_batch([_prompt_part(p) for p in batch], template_kwargs),
                               strict=True):
            if isinstance(ids, list):
                counts.append(len(ids))
            if earlier_answer_chars(prompt.messages):
                answers.append(len(tokenizer(_answer_text(prompt.messages), add_special_tokens=False)["input_ids"]))
    return LengthSample(rows=len(prompts), prompt_tokens=tuple(counts), answer_tokens=tuple(answers), whole=whole)


def estimated_lengths(prompts: list[Prompt], whole: bool = False) -> LengthSample:
    """Lengths without a tokenizer: characters over CHARS_PER_TOKEN for the ETA, and each prompt's UTF-8 bytes
    (plus the template's tokens per message) as the bound the context length is sized from."""
    counts, bounds, answers = [], [], []
    for prompt in prompts:
        part = _prompt_part(prompt)
        text = _prompt_text(part)
        counts.append(max(1, math.ceil(len(text) / CHARS_PER_TOKEN)))
        bounds.append(len(text.encode()) + TEMPLATE_TOKENS_PER_MESSAGE * (len(part.messages) + 1))
        if chars := earlier_answer_chars(prompt.messages):
            answers.append(max(1, math.ceil(chars / CHARS_PER_TOKEN)))
    return LengthSample(rows=len(prompts), prompt_tokens=tuple(counts), answer_tokens=tuple(answers), whole=whole,
                        estimated=True, prompt_token_bounds=tuple(bounds))


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _tokenizer(spec: DatasetGenerationSpec, location: str | None, reader: SurveyReader) -> tuple[Any, str | None]:
    """(tokenizer, None), or (None, why the prompt lengths are estimated from characters instead)."""
    if not reader.tokenize:
        return None, "the operator loads no tokenizer: estimated from characters"
    if not location:
        return None, "no tokenizer location (spec.model.tokenizer or spec.model.path)"
    try:
        folder = local_model_folder(location, reader.endpoint, reader.retry)
        return load_tokenizer(folder, spec.model.trust_remote_code), None
    except Exception as error:  # noqa: BLE001 - any failure to load leaves the estimate, with why
        return None, f"tokenizer at {location} not read ({_short(error)}){reader.hint and '; ' + reader.hint}"


def surveyed_workload(spec: DatasetGenerationSpec, work: Workload, tokenizer_location: str | None,
                      reader: SurveyReader = SurveyReader(),
                      clock: Callable[[], float] = time.monotonic) -> Workload:
    """`work` with each dataset's rows counted and its lengths read from a sample of its source."""
    started = clock()
    tokenizer: Any = None
    tokenizer_why: str | None = None
    loaded = False
    bound = RowBound.of(spec.server.context_length if isinstance(spec.server.context_length, int) else None)
    by_name = {d.name: d for d in spec.datasets}
    loads = []
    for load in work.datasets:
        dataset = by_name.get(load.name)
        if dataset is None:
            loads.append(load)
            continue
        left = reader.seconds - (clock() - started)
        why = _unreadable(dataset.source, reader, left)
        survey: SourceSurvey | None = None
        if why is None:
            try:
                fmt = source_format(dataset.source, dataset.format, reader.endpoint, reader.opener)
                survey = survey_source(dataset.source, fmt, reader.endpoint, dataset.limit, dataset.row_layout(),
                                       bound, replace(reader.bounds, seconds=min(reader.bounds.seconds, left)),
                                       clock, opener=reader.opener)
            except (SourceError, StorageError, OSError, ValueError) as error:
                said = _short(error)
                said = said if dataset.source in said else f"cannot read {dataset.source}: {said}"
                why = f"{said}{reader.hint and '; ' + reader.hint}"
        if survey is None:
            logger.debug("dataset %s: %s; the plan assumes its size and lengths", load.name, why)
            loads.append(replace(load, rows_how=f"assumed: {why}" if not load.samples_known else load.rows_how,
                                 prompt_why=why if load.samples_known else "its source was not read (above)"))
            continue
        samples = survey.rows * dataset.samples
        updated = replace(load, samples=samples, samples_known=survey.exact, rows_how=survey.how)
        prompts = list(survey.sample)
        whole = survey.exact and len(prompts) + survey.refused >= survey.rows
        if not prompts:
            loads.append(replace(updated, prompt_why=f"no prompt among the {survey.rows:,} rows read"))
            continue
        if not loaded:
            tokenizer, tokenizer_why = _tokenizer(spec, tokenizer_location, reader)
            loaded = True
        if tokenizer is not None:
            sample = sample_lengths(PromptEncoder(tokenizer), tokenizer, prompts,
                                    spec.chat_template_kwargs_for(dataset), whole)
        else:
            sample = estimated_lengths(prompts, whole)
        if not sample.prompt_tokens:
            loads.append(replace(updated, prompt_why="no sampled prompt rendered with the chat template"))
            continue
        loads.append(replace(updated, prompt_tokens=sample.mean_prompt, sample=sample,
                             prompt_why=tokenizer_why if tokenizer is None else None))
    return replace(work, datasets=tuple(loads))


def _unreadable(source: str, reader: SurveyReader, seconds_left: float) -> str | None:
    if seconds_left <= 0:
        return f"the plan's {reader.seconds:g} s for reading sources were spent on the datasets before this one"
    if not source.startswith("s3://") and not reader.local:
        return (f"{source} is not on S3: the operator reads sources only from S3 (its own filesystem is not the "
                "tenant's)")
    return None


def operator_reader(spec: DatasetGenerationSpec, credentials: Mapping[str, str] | None,
                    retry: StorageRetry | None) -> SurveyReader:
    """How the operator reads a tenant's sources at plan time: S3 only, with the tenant's credentials and the
    operator's short retries, every call under the pass's read deadline and byte budget (tenant_store.py), no
    tokenizer, within OPERATOR_SECONDS for every dataset together."""
    output = spec.output

    def opener(uri: str) -> Storage:
        return TenantStorage(open_storage(uri, output.endpoint, output.region, credentials, retry))

    return SurveyReader(endpoint=output.endpoint, opener=opener, local=False, tokenize=False,
                        seconds=OPERATOR_SECONDS, bounds=OPERATOR_BOUNDS)

"""The job's lengths read at plan time: a bounded sample of each dataset's rows, streamed from its source, rendered
with the model's chat template and tokenized, for its prompt-length distribution and (where rows carry the
assistant turns being regenerated) its earlier answers' lengths. The storage and tokenizer edge of
facts/workload.py's LengthSample; the planner stays pure.

Bounded twice: at most SAMPLE_ROWS rows per dataset are read (the reader stops there, so a 2M-row source costs what
a 2,000-row one does), and every row passes the runner's own row bound before it is parsed (source/row_size.py).
A dataset whose source cannot be read keeps the flat estimate, and the plan says so; nothing here fails the plan.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from tokenmill_runner.facts.workload import LengthSample, Workload
from tokenmill_runner.generate.ordering import earlier_answer_chars
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer, local_model_folder
from tokenmill_runner.source.prompts import Prompt
from tokenmill_runner.source.reader import SourceError, read_prompts, source_format
from tokenmill_runner.source.row_size import RowBound
from tokenmill_runner.spec.resource import DatasetGenerationSpec

logger = logging.getLogger(__name__)

SAMPLE_ROWS = 2000
ENCODE_BATCH = 256


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


def sample_lengths(encoder: PromptEncoder, tokenizer: Any, prompts: list[Prompt],
                   template_kwargs: dict[str, Any] | None = None) -> LengthSample:
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
    return LengthSample(rows=len(prompts), prompt_tokens=tuple(counts), answer_tokens=tuple(answers))


def sampled_workload(spec: DatasetGenerationSpec, work: Workload, tokenizer_location: str,
                     rows: int = SAMPLE_ROWS) -> Workload:
    """`work` with each dataset's sample read: its mean prompt length and its distribution replace the estimate."""
    endpoint = spec.output.endpoint
    folder = local_model_folder(tokenizer_location, endpoint)
    tokenizer = load_tokenizer(folder, spec.model.trust_remote_code)
    encoder = PromptEncoder(tokenizer)
    bound = RowBound.of(spec.server.context_length if isinstance(spec.server.context_length, int) else None)
    loads = []
    by_name = {d.name: d for d in spec.datasets}
    for load in work.datasets:
        dataset = by_name.get(load.name)
        if dataset is None:
            loads.append(load)
            continue
        try:
            fmt = source_format(dataset.source, dataset.format, endpoint)
            limit = min(rows, dataset.limit) if dataset.limit else rows
            prompts = [p for p in read_prompts(dataset.source, fmt, endpoint, limit, layout=dataset.row_layout(),
                                               bound=bound) if isinstance(p, Prompt)]
        except (SourceError, OSError, ValueError) as error:
            logger.warning("dataset %s: no length sample (%s); the plan keeps the estimate", load.name, error)
            loads.append(load)
            continue
        sample = sample_lengths(encoder, tokenizer, prompts, spec.chat_template_kwargs_for(dataset))
        if not sample.prompt_tokens:
            loads.append(load)
            continue
        loads.append(replace(load, prompt_tokens=sample.mean_prompt, sample=sample))
    return replace(work, datasets=tuple(loads))

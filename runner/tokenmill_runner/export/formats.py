"""The export formats: each trainer's input, built from generation units. Pure (records are plain dicts).

Formats and the reader each one is written for (SpecForge 0.2.0 `SF`, speculators 0.9.0 `SP`; the rules, with
file:line, are in docs/export.md):
- `specforge`: pre-tokenized JSONL for SpecForge's `data.prompts_path` (`SF data/prompt_builder.py:219-287`), one
  record per generation, `input_ids` + `loss_mask` (0/1, equal lengths, at least one 1), in parts under prompts/:
  SpecForge reads one path and holds all of it as Python lists (about 37 bytes per token, measured), so each part
  is a file one SpecForge process can hold.
- `speculators`: JSONL parts under data/ for `speculators prepare-data --data DEST/data` (`SP
  data_generation/preprocessing.py:458-483, 725-777`), one record per generation event as its own regenerator
  writes them (`id`, `primary_id`, `input_ids`, `loss_mask`, `metadata`).
- `hf`: Parquet parts under data/ with `input_ids`, `loss_mask` and metadata columns, features declared in the
  `huggingface` schema metadata, for `datasets.load_dataset(DEST)`.
- `specforge-conversations`: SpecForge's conversations JSONL (`data.train_data_path`), one record per
  conversation, reasoning in `reasoning_content`; re-rendered by the trainer, so every record is checked first.
- `specforge-text`: SpecForge's pre-formatted text JSONL (`data.is_preformatted: true`); re-tokenized by the
  trainer, so every record is checked first.
- `specforge-offline`: SpecForge's offline EAGLE-3 features (`SF data/preprocessing.py:394-560`), one `.ckpt` per
  sample under features/<dataset>/ with `input_ids`, `loss_mask`, `hidden_state` (the final state) and
  `aux_hidden_state`, from the run's captured hidden states (export/offline.py).
- `speculators-offline`: speculators' offline EAGLE-3 data (`SP train/data.py:147-335`, ArrowDataset): a
  `datasets` save_to_disk folder under dataset/ with `input_ids`, `loss_mask` and `seq_len`, and beside it
  hidden_states/hs_{i}.safetensors for row i, the run's stored states files as they are (export/speculators_offline.py).
- `vocab`: draft-vocabulary maps from the loss-token counts (export/vocab.py): speculators' token_freq.pt and
  d2t-<size>.npy / t2d-<size>.npy, SpecForge's model.vocab_mapping_path file, SGLang's --speculative-token-map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from .units import GenerationUnit


@dataclass(frozen=True)
class ExportFormat:
    name: str
    kind: Literal["jsonl", "parquet", "ckpt", "arrow", "vocab"]
    # A single file (SpecForge reads one path) or numbered parts under data/ (readers that take a folder).
    single_file: str | None
    part_prefix: str | None
    text: bool  # the trainer re-renders or re-tokenizes text: needs the tokenizer and the round-trip check
    reads: str  # which reader of which trainer, for the manifest and the summary
    usage: str  # how to point the trainer at it ({dest} is the export's destination)
    names: str | None = None  # a pattern of the files it writes at the top of DEST (besides parts and single files)

    def part_name(self, index: int) -> str:
        return f"{self.part_prefix}{index:05d}.{'parquet' if self.kind == 'parquet' else 'jsonl'}"


FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    ExportFormat("specforge", "jsonl", None, "prompts/part-", False,
                 "SpecForge 0.2.0 pre-tokenized prompts (data.prompts_path, online training)",
                 "data.prompts_path: {dest}/prompts/part-00000.jsonl (one part per path; export.json lists them)"),
    ExportFormat("speculators", "jsonl", None, "data/part-", False,
                 "speculators 0.9.0 prepare-data, speculator-format rows (input_ids + loss_mask pass through)",
                 "speculators prepare-data --data {dest}/data --model <tokenizer folder> --output <prepared>"),
    ExportFormat("hf", "parquet", None, "data/train-", False,
                 "Hugging Face datasets (Parquet with declared features)",
                 "datasets.load_dataset('{dest}')  # or load_dataset('parquet', data_files='{dest}/data/*.parquet')"),
    ExportFormat("specforge-conversations", "jsonl", "conversations.jsonl", None, True,
                 "SpecForge 0.2.0 conversations (data.train_data_path, online training; not prepare_hidden_states.py)",
                 "data.train_data_path: {dest}/conversations.jsonl, data.chat_template: <SpecForge template>, "
                 "data.train_only_last_turn: true"),
    ExportFormat("specforge-text", "jsonl", "text.jsonl", None, True,
                 "SpecForge 0.2.0 pre-formatted text (data.is_preformatted: true)",
                 "data.train_data_path: {dest}/text.jsonl, data.is_preformatted: true, data.chat_template: "
                 "<SpecForge template>, data.train_only_last_turn: true"),
    ExportFormat("specforge-offline", "ckpt", None, "features/", False,
                 "SpecForge 0.2.0 offline EAGLE-3 features (OfflineEagle3Dataset, .ckpt per sample)",
                 "data.hidden_states_path: {dest}/features (SpecForge reads every .ckpt under it, sorted)"),
    ExportFormat("speculators-offline", "arrow", None, "dataset/", False,
                 "speculators 0.9.0 offline EAGLE-3 data (ArrowDataset: load_from_disk + hidden_states/hs_{i})",
                 "speculators train --data-path {dest}/dataset --on-missing raise ..."),
    ExportFormat("vocab", "vocab", None, None, False,
                 "draft-vocabulary maps: speculators 0.9.0 token_freq.pt + d2t/t2d, SpecForge 0.2.0 "
                 "model.vocab_mapping_path, SGLang 0.5.23 --speculative-token-map",
                 "export.json names each file and the flag that reads it",
                 names=r"token_freq\.pt|[dt]2[td]-\d+\.npy|specforge-vocab-mapping-\d+\.pt|sglang-token-map-\d+\.pt"),
)}


def metadata(unit: GenerationUnit) -> dict[str, Any]:
    """Per-record facts, with no nulls: `datasets` reads JSON parts one by one and fails to merge a column that is
    null everywhere in one part with the same column holding numbers in another (checked with datasets 5.2)."""
    return {
        "dataset": unit.dataset, "sample_id": unit.sample_id, "sample_index": unit.sample_index,
        "turn_index": unit.turn_index, "turns": unit.turns, "line": unit.line,
        "finish_reason": unit.finish_reason or "", "prompt_tokens": len(unit.prompt_ids),
        "completion_tokens": unit.supervised_tokens, "has_reasoning": unit.has_reasoning,
        "reasoning_tokens": unit.reasoning_end or 0, "has_tool_call": unit.has_tool_call,
        "max_new_tokens": unit.max_new_tokens or 0, "history_exact": unit.history_exact,
    }


def specforge_record(unit: GenerationUnit) -> dict[str, Any]:
    # SpecForge reads input_ids and loss_mask and ignores every other key (SF data/prompt_builder.py:219-252).
    return {"id": unit.id, "input_ids": unit.input_ids, "loss_mask": unit.loss_mask, **metadata(unit)}


def speculators_record(unit: GenerationUnit) -> dict[str, Any]:
    # The shape of speculators' own regenerator rows (SP cli/regenerate_responses.py:388-407); prepare-data keeps
    # input_ids and loss_mask and drops the other columns (SP data_generation/preprocessing.py:632-634).
    return {"id": unit.id, "primary_id": unit.conversation_id, "input_ids": unit.input_ids,
            "loss_mask": unit.loss_mask, "metadata": metadata(unit)}


# Parquet columns of the hf export: (name, Arrow type name). The writer maps type names to Arrow types.
HF_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "string"), ("conversation_id", "string"), ("dataset", "string"), ("sample_id", "string"),
    ("sample_index", "int32"), ("turn_index", "int32"), ("turns", "int32"), ("line", "int64"),
    ("input_ids", "list<int32>"), ("loss_mask", "list<int8>"), ("prompt_tokens", "int32"),
    ("completion_tokens", "int32"), ("finish_reason", "string"), ("reasoning_end", "int32"),
    ("has_tool_call", "bool"), ("max_new_tokens", "int32"), ("history_exact", "bool"),
)


def hf_record(unit: GenerationUnit) -> dict[str, Any]:
    return {
        "id": unit.id, "conversation_id": unit.conversation_id, "dataset": unit.dataset,
        "sample_id": unit.sample_id, "sample_index": unit.sample_index,
        "turn_index": unit.turn_index, "turns": unit.turns, "line": unit.line, "input_ids": unit.input_ids,
        "loss_mask": unit.loss_mask, "prompt_tokens": len(unit.prompt_ids), "completion_tokens": unit.supervised_tokens,
        "finish_reason": unit.finish_reason, "reasoning_end": unit.reasoning_end,
        "has_tool_call": unit.has_tool_call, "max_new_tokens": unit.max_new_tokens,
        "history_exact": unit.history_exact,
    }


def features(columns: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """`datasets` Features.to_dict() of (name, Arrow type name) columns, spelled so that datasets 3.x and 5.x both
    read it: lists as `"_type": "Sequence"` (datasets >= 4 writes "List", which 3.6 rejects; 5.x still reads
    "Sequence", datasets/features/features.py:1670-1672 in 5.2.0)."""
    def feature(arrow: str) -> dict[str, Any]:
        if arrow.startswith("list<"):
            return {"feature": feature(arrow[len("list<"):-1]), "_type": "Sequence"}
        return {"dtype": arrow, "_type": "Value"}

    return {name: feature(arrow) for name, arrow in columns}


def hf_features() -> dict[str, Any]:
    return features(HF_COLUMNS)


def schema_metadata(columns: tuple[tuple[str, str], ...]) -> bytes:
    # What datasets' ArrowWriter stores under b"huggingface" (datasets/arrow_writer.py:640-649, 5.2.0).
    return orjson.dumps({"info": {"features": features(columns)}})


def hf_schema_metadata() -> bytes:
    return schema_metadata(HF_COLUMNS)


# Columns of the speculators-offline dataset: what speculators prepare-data saves (input_ids and loss_mask as torch
# longs, seq_len; SP data_generation/preprocessing.py:397-400) and where each row came from. ArrowDataset reads
# input_ids, loss_mask and seq_len (SP train/data.py:225, 314-334); the others are never read.
SPECULATORS_COLUMNS: tuple[tuple[str, str], ...] = (
    ("input_ids", "list<int64>"), ("loss_mask", "list<int64>"), ("seq_len", "int64"), ("dataset", "string"),
    ("sample_id", "string"), ("sample_index", "int64"),
)


def speculators_row(unit: GenerationUnit) -> dict[str, Any]:
    return {"input_ids": unit.input_ids, "loss_mask": unit.loss_mask, "seq_len": len(unit.input_ids),
            "dataset": unit.dataset, "sample_id": unit.sample_id, "sample_index": unit.sample_index}


def text_record(unit: GenerationUnit, text: str) -> dict[str, Any]:
    return {"id": unit.id, "text": text}


def conversation_record(unit: GenerationUnit, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        template_kwargs: dict[str, Any]) -> dict[str, Any]:
    # tools as a JSON string: SpecForge accepts a string or a list (SF data/preprocessing.py:261-284), and a string
    # keeps `datasets` from merging every row's tool schemas into one struct with nulls for the keys a tool lacks.
    # Every other column reaches the chat template as a keyword argument (SF data/preprocessing.py:293), which is
    # how the run's own chat template arguments travel with the row.
    return {"id": unit.conversation_id, "conversations": conversation,
            "tools": orjson.dumps(tools or []).decode(), **template_kwargs}

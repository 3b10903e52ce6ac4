"""The export's pure core: generation units, filters, records, SpecForge's conversation rules, the round-trip
check and the manifest's lines. The formats read back by the trainers' readers are in
tests/integration/test_export.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.reference.families import FIXTURES
from tokenmill_runner.export.exporter import answered_history
from tokenmill_runner.export.filters import ExportFilters, FilterError, excluded_by_findings, select_datasets
from tokenmill_runner.export.formats import HF_COLUMNS, hf_features, hf_record, metadata, speculators_record
from tokenmill_runner.export.manifest import ExportProgress, progress_line
from tokenmill_runner.export.roundtrip import (
    ConversationContext,
    check_conversation,
    check_text,
    first_difference,
    split_output,
)
from tokenmill_runner.export.specforge_rules import (
    SPECFORGE_TEMPLATES,
    UnknownTemplate,
    loss_mask,
    mask_difference,
    prepare,
    specforge_template,
)
from tokenmill_runner.export.units import SlotSeen, invalid_reason, units_from_row
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer
from tokenmill_runner.source.prompts import Prompt


def row(**over: Any) -> dict[str, Any]:
    base = {"sample_id": "s1", "dataset": "d", "line": 7, "prompt_ids": [1, 2, 3], "output_ids": [4, 5, 9],
            "finish_reason": "stop", "matched_stop": 9, "reasoning_end": 1, "reasoning_end_token_id": 5,
            "has_tool_call": False, "max_new_tokens": 100}
    return {**base, **over}


def test_a_row_is_one_unit_with_the_prompt_masked_out():
    [unit] = units_from_row(row())
    assert unit.input_ids == [1, 2, 3, 4, 5, 9] and unit.loss_mask == [0, 0, 0, 1, 1, 1]
    assert unit.id == "d/s1#s0#t0" and unit.conversation_id == "d/s1#s0" and unit.turns == 1


def test_sample_index_and_turns_travel_into_the_units():
    turns = [{"prompt_ids": [1, 2], "output_ids": [3, 9], "finish_reason": "stop"},
             {"prompt_ids": [1, 2, 3, 9, 4], "output_ids": [5, 6], "finish_reason": "length", "reasoning_end": None}]
    units = list(units_from_row(row(sample_index=2, turns=turns)))
    assert [u.id for u in units] == ["d/s1#s2#t0", "d/s1#s2#t1"]
    assert units[1].input_ids == [1, 2, 3, 9, 4, 5, 6] and units[1].loss_mask == [0] * 5 + [1, 1]
    assert units[1].truncated and not units[1].has_reasoning and units[0].has_reasoning
    assert {u.turns for u in units} == {2}


def test_slots_are_seen_once_per_line_and_sample_index():
    seen = SlotSeen()
    assert seen.add(5) and not seen.add(5)
    assert seen.add(5, sample_index=1) and seen.add(100_000) and not seen.add(100_000)


def test_units_no_trainer_should_get():
    assert invalid_reason(next(units_from_row(row(output_ids=[]))), 100) == "no_output_tokens"
    assert invalid_reason(next(units_from_row(row())), 9) == "id_out_of_vocab"
    assert invalid_reason(next(units_from_row(row())), 10) is None


def test_filters_say_which_one_left_a_unit_out():
    cut = next(units_from_row(row(finish_reason="length", reasoning_end=None)))
    whole = next(units_from_row(row()))
    assert ExportFilters(finish_reason="stop").rejection(cut) == "finish_reason"
    assert ExportFilters(exclude_truncated=True).rejection(cut) == "truncated"
    assert ExportFilters(require_reasoning=True).rejection(cut) == "no_reasoning"
    assert ExportFilters(finish_reason="stop", exclude_truncated=True, require_reasoning=True).rejection(whole) is None
    with pytest.raises(FilterError, match="--exclude-findings"):
        ExportFilters(exclude_findings="pass")
    with pytest.raises(FilterError, match="--dataset x: not in this run"):
        select_datasets(["a", "b"], ("x",))


def test_findings_exclude_datasets_at_or_above_a_level():
    findings = [{"dataset": "a", "level": "warn", "message": "a: truncated"},
                {"dataset": "b", "level": "fail", "message": "b: no reasoning"},
                {"dataset": "c", "level": "pass", "message": "c: fine"}]
    assert excluded_by_findings(findings, "fail") == {"b": ["b: no reasoning"]}
    assert set(excluded_by_findings(findings, "warn")) == {"a", "b"}
    assert excluded_by_findings(findings, None) == {}


def test_records_carry_no_nulls_and_hf_lists_are_sequences():
    unit = next(units_from_row(row(finish_reason="length", reasoning_end=None, max_new_tokens=None,
                                   matched_stop=None)))
    assert None not in metadata(unit).values()
    record = speculators_record(unit)
    assert record["primary_id"] == "d/s1#s0" and record["metadata"]["reasoning_tokens"] == 0
    assert hf_features()["loss_mask"] == {"feature": {"dtype": "int8", "_type": "Value"}, "_type": "Sequence"}


def test_specforge_prepares_conversations_as_its_parser_does():
    kimi, qwen = specforge_template("kimi-k2-thinking"), specforge_template("qwen3-instruct")
    conversation = [{"role": "user", "content": "u"},
                    {"role": "assistant", "content": None, "reasoning_content": "r", "weight": 1,
                     "tool_calls": '[{"id": "c1", "function": {"name": "f", "arguments": "{\\"x\\": 1}"}, "x": 2}]'},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    prepared = prepare(conversation, kimi, {"thinking": True})
    assert prepared.inserted_system_prompt and prepared.messages[0] == {"role": "system",
                                                                        "content": "You are a helpful assistant."}
    assistant = prepared.messages[2]
    assert assistant["content"] == "" and assistant["reasoning_content"] == "r" and "weight" not in assistant
    assert assistant["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "f",
                                                                                     "arguments": {"x": 1}}}]
    assert prepared.template_kwargs == {"thinking": True, "add_special_tokens": False, "enable_thinking": True}
    # The general parser drops reasoning_content before the template sees it; a tool after a user ends it there.
    general = prepare([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                       {"role": "tool", "content": "t"}, {"role": "user", "content": "v"}], qwen, {})
    assert general.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert not general.inserted_system_prompt and general.template_kwargs == {}
    with pytest.raises(UnknownTemplate, match="gpt-oss.*kimi-k2-thinking"):
        specforge_template("gpt-oss")
    # Its end_of_turn_token is None, which SpecForge's mask pattern cannot escape (SF data/parse.py:179-185).
    assert "deepseek-r1-distill" not in SPECFORGE_TEMPLATES


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token per character: spans are easy to read


def test_specforge_loss_mask_runs_from_the_assistant_header_through_the_end_of_turn():
    qwen = specforge_template("qwen3-thinking")
    text = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nr<|im_end|>\n" \
           "<|im_start|>assistant\nB<|im_end|>\n"
    mask = loss_mask(chars, text, qwen)
    supervised = "".join(c for c, m in zip(text, mask, strict=True) if m)
    assert supervised == "B<|im_end|>\n"  # the last turn only (data.train_only_last_turn: true), suffix included
    every = "".join(c for c, m in zip(text, loss_mask(chars, text, qwen, train_only_last_turn=False), strict=True) if m)
    assert every == "A<|im_end|>\nB<|im_end|>\n"  # SpecForge's default also trains on the history's answers
    # qwen3-instruct unsupervises its empty thinking block again (its ignore_token)
    empty = "<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n"
    kept = "".join(c for c, m in zip(empty, loss_mask(chars, empty, specforge_template("qwen3-instruct")), strict=True) if m)
    assert kept == "B<|im_end|>\n"


def test_mask_difference_names_prompt_output_and_suffix_tokens():
    target = [0, 0, 0, 1, 1, 1]
    assert mask_difference(target, target, 3).first is None
    trainer = [0, 0, 1, 1, 0, 1, 1]  # one prompt token trained, one generated token skipped, one suffix trained
    difference = mask_difference(target, trainer, 3)
    assert (difference.prompt_supervised, difference.output_unsupervised, difference.suffix_supervised) == (1, 1, 1)
    assert difference.first == 2 and difference.tokens == 3


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 7]) == 2
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_output_split_at_the_end_of_reasoning():
    # </think> is dropped (the template writes it); a tool-call section that ended reasoning stays in the answer.
    think = next(units_from_row(row(output_ids=[7, 4, 5, 6, 9], reasoning_end=2, reasoning_end_token_id=5)))
    assert split_output(think, frozenset({7}), tool_call_id=8) == split_output(think, frozenset({7}), None)
    split = split_output(think, frozenset({7}), 8)
    assert (split.reasoning, split.content) == ([4], [6])
    section = next(units_from_row(row(output_ids=[4, 8, 6, 9], reasoning_end=1, reasoning_end_token_id=8)))
    split = split_output(section, frozenset(), 8)
    assert (split.reasoning, split.content) == ([4], [8, 6])
    cut = next(units_from_row(row(output_ids=[4, 4], finish_reason="length", reasoning_end=None, matched_stop=None)))
    assert split_output(cut, frozenset(), 8).reasoning is None and split_output(cut, frozenset(), 8).content == [4, 4]


def demo_unit(tokenizer: Any, messages: list[dict[str, Any]], output: str) -> tuple[Any, Prompt]:
    prompt = Prompt(1, "s1", messages, None)
    prompt_ids = PromptEncoder(tokenizer).encode_one(prompt)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    output_ids = tokenizer(output, add_special_tokens=False)["input_ids"] + [end]
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    reasoning_end = output_ids.index(think_end) if think_end in output_ids else None
    unit = next(units_from_row(row(prompt_ids=prompt_ids, output_ids=output_ids, matched_stop=end,
                                   reasoning_end=reasoning_end, reasoning_end_token_id=think_end)))
    return unit, prompt


def test_text_round_trip_of_a_canonical_sample_and_specforge_s_mask_over_it(tokenizer):
    unit, _ = demo_unit(tokenizer, [{"role": "user", "content": "Hi"}], "Let me see.</think>Hello there.")
    checked = check_text(tokenizer, unit, specforge_template("kimi-k2-thinking"))
    assert checked.record == {"id": "d/s1#s0#t0", "text": tokenizer.decode(unit.input_ids, skip_special_tokens=False)}
    # The ids round-trip, but SpecForge's mask starts at the assistant header, before the <think> the demo
    # template's generation prompt wrote: one prompt token the target never generated is trained on.
    assert checked.mismatch is not None and checked.mismatch.reason == "trainer_loss_mask"
    assert checked.mask is not None and (checked.mask.prompt_supervised, checked.mask.tokens) == (1, 1)
    assert checked.mismatch.position == len(unit.prompt_ids) - 1 and "'<think>'" in checked.mismatch.detail


def test_the_demo_template_drops_reasoning_and_specforge_adds_a_system_prompt(tokenizer):
    # examples/demo-model/chat_template.jinja renders every assistant message as <think></think> + content (as
    # Kimi does for history), and has no default system prompt, so SpecForge's kimi-k2-thinking inserts its own.
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    unit, prompt = demo_unit(tokenizer, messages, "Let me see.</think>Hello there.")
    context = ConversationContext(specforge_template("kimi-k2-thinking"), {}, frozenset(), None)
    checked = check_conversation(tokenizer, unit, prompt, context)
    assert checked.mismatch is not None and checked.mismatch.reason == "reasoning_dropped"
    assert checked.mismatch.position == len(unit.prompt_ids)
    assert checked.record["conversations"][-1]["reasoning_content"] == "Let me see."
    # With an empty reasoning (the generation prompt opened <think>, the model closed it at once) the demo
    # template's <think></think> is what was generated.
    no_system, prompt = demo_unit(tokenizer, messages[1:], "</think>Hello there.")
    checked = check_conversation(tokenizer, no_system, prompt, context)
    assert checked.mismatch is not None and checked.mismatch.reason == "trainer_system_prompt"
    # A SpecForge template without a system prompt leaves the conversation as it is: the ids round-trip, but its
    # assistant header is not this model's, so SpecForge would train on nothing the target generated.
    plain = ConversationContext(specforge_template("lfm"), {}, frozenset(), None)
    checked = check_conversation(tokenizer, no_system, prompt, plain)
    assert checked.mismatch is not None and checked.mismatch.reason == "trainer_loss_mask"
    assert checked.mask is not None and checked.mask.output_unsupervised == len(no_system.output_ids)


def test_progress_line():
    line = progress_line(ExportProgress(done=250, total=1000, written=240, mismatched=3, units_per_s=50.0,
                                        elapsed_s=5.0))
    assert "250/1,000 units" in line and "( 25.0%)" in line and "50 units/s" in line and "ETA 00:00:15" in line


def conversation_row(exact: bool) -> dict:
    # turn 1's prompt extends turn 0's prompt + output exactly (a template that keeps history as generated), or not
    turn0 = {"prompt_ids": [1, 2, 3], "output_ids": [10, 11, 9], "finish_reason": "stop", "history_exact": None,
             "has_tool_call": True}
    prompt1 = [1, 2, 3, 10, 11, 9, 4, 5] if exact else [1, 2, 3, 11, 9, 4, 5]
    turn1 = {"prompt_ids": prompt1, "output_ids": [12, 9], "finish_reason": "stop", "history_exact": exact,
             "has_tool_call": False}
    return {"dataset": "d", "sample_id": "c1", "line": 4, "sample_index": 0, "prompt_ids": prompt1,
            "output_ids": [12, 9], "finish_reason": "stop", "has_tool_call": True, "turns": [turn0, turn1],
            "turn_count": 2, "stop_reason": "complete"}


def test_a_conversation_with_an_exact_history_exports_as_one_record_supervised_on_every_turn():
    (unit,) = units_from_row(conversation_row(True), per_conversation=True)
    assert unit.id == "d/c1#s0" and unit.input_ids == [1, 2, 3, 10, 11, 9, 4, 5, 12, 9]
    assert unit.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1] and unit.supervised_tokens == 5
    assert unit.has_tool_call and metadata(unit)["completion_tokens"] == 5
    # per turn (the default), and per turn where the template rewrote the history
    assert [u.id for u in units_from_row(conversation_row(True))] == ["d/c1#s0#t0", "d/c1#s0#t1"]
    split = list(units_from_row(conversation_row(False), per_conversation=True))
    assert [u.id for u in split] == ["d/c1#s0#t0", "d/c1#s0#t1"] and not split[1].history_exact


def test_hf_records_carry_history_exact_and_the_conversation_id():
    unit = list(units_from_row(conversation_row(False)))[1]
    record = hf_record(unit)
    assert (record["history_exact"], record["conversation_id"]) == (False, "d/c1#s0")
    assert set(record) == {name for name, _ in HF_COLUMNS}


def test_a_conversation_stopped_after_turn_0_is_exported_with_the_history_it_answered():
    tokenizer = load_tokenizer(str(FIXTURES / "qwen3"))
    system, ask = {"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}
    source = Prompt(1, "c1", [system, ask, {"role": "assistant", "content": "Four."},
                              {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "Six."}], None)
    history = answered_history(source)
    assert isinstance(history, Prompt) and history.messages == [system, ask]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn = {"prompt_ids": PromptEncoder(tokenizer).encode_one(history), "history_exact": None,
            "output_ids": tokenizer("<think>\nEasy.\n</think>\n\nIt is 4.", add_special_tokens=False)["input_ids"]
            + [end], "finish_reason": "stop", "matched_stop": end, "reasoning_end_token_id": end}
    turn["reasoning_end"] = turn["output_ids"].index(tokenizer.convert_tokens_to_ids("</think>"))
    (unit,) = units_from_row({**row(), "sample_id": "c1", "line": 1, "turns": [turn], "stop_reason": "truncated"})
    assert unit.in_conversation
    context = ConversationContext(specforge_template("qwen3-thinking"), {}, frozenset(
        {tokenizer.convert_tokens_to_ids("<think>")}), None)
    checked = check_conversation(tokenizer, unit, history, context)
    assert [m["content"] for m in checked.record["conversations"]] == ["You are terse.", "What is 2 + 2?",
                                                                      "\n\nIt is 4."]
    # The ids are the generated ones exactly; what remains is Qwen's "\n" after <|im_end|>, which SpecForge trains
    assert checked.mask is not None and (checked.mask.suffix_supervised, checked.mask.tokens) == (1, 1)
    # Built from the whole source row, the source's later turns would sit around the answer: the ids differ.
    whole = check_conversation(tokenizer, unit, source, context)
    assert whole.mismatch is not None and whole.mismatch.reason != "trainer_loss_mask"


def test_an_arrow_dataset_in_parts_loads_as_datasets_saved_it(tmp_path):
    """export/writers.ArrowDatasetFiles writes the folder datasets' save_to_disk writes; load_from_disk (datasets
    5.2.0 arrow_dataset.py) reads the parts state.json lists, in order, and the format it names (None here: the
    torch format speculators-offline names needs torch, which tests/integration/test_speculators_offline.py has)."""
    from datasets import load_from_disk

    from tokenmill_runner.export.formats import SPECULATORS_COLUMNS
    from tokenmill_runner.export.writers import ROW_GROUP_RECORDS, ArrowDatasetFiles
    from tokenmill_runner.store.storage import LocalStorage

    spool = tmp_path / "spool"
    spool.mkdir()
    rows = [{"input_ids": list(range(i % 7 + 1)), "loss_mask": [0] * (i % 7) + [1], "seq_len": i % 7 + 1,
             "dataset": "d", "sample_id": f"s{i}", "sample_index": 0} for i in range(2 * ROW_GROUP_RECORDS + 5)]
    writer = ArrowDatasetFiles(LocalStorage(tmp_path / "dest"), spool, "dataset/", SPECULATORS_COLUMNS, 1)
    assert [writer.write(row) for row in rows] == list(range(len(rows)))
    files = writer.close("0123456789abcdef")
    assert len(files) == 3 and [f.records for f in files] == [ROW_GROUP_RECORDS, ROW_GROUP_RECORDS, 5]
    loaded = load_from_disk(str(tmp_path / "dest" / "dataset"))
    assert loaded.to_list() == rows and loaded.features["input_ids"].feature.dtype == "int64"
    empty = ArrowDatasetFiles(LocalStorage(tmp_path / "empty"), spool, "", SPECULATORS_COLUMNS, 1 << 20)
    assert len(empty.close("0")) == 1 and len(load_from_disk(str(tmp_path / "empty"))) == 0

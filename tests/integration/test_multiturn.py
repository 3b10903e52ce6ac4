"""Multi-turn regeneration (mode all-turns) end to end over real HTTP: the demo's conversations with tool calls
(examples/prompts/conversations.jsonl), regenerated turn by turn by the simulator (which calls the tool a user
message names, and something else now and then: runner/sim/tokenmill_sim/tokens.py requested_plan), committed
whole, and redone whole after a SIGKILL mid-conversation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tokenmill_runner.export.units import units_from_row
from tokenmill_runner.generate.conversation import STOP_REASONS
from tokenmill_runner.generate.results import GenerationFailure
from tokenmill_runner.generate.seeds import sample_seed
from tokenmill_runner.generate.summary import EXIT_OK
from tokenmill_runner.prepare import prepare
from tokenmill_runner.spec.config import RunnerConfig
from tokenmill_runner.spec.resource import load_spec_file
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import LocalStorage, open_storage

from .test_exactly_once import killed_at, outcomes_per_line, run_cli
from .test_run import assert_exactly_once, committed_errors, run_spec
from .workloads import spec_document, write_spec

CONVERSATIONS = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "conversations.jsonl"


@pytest.fixture
def sim(demo_model: Path):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, max_running_requests=32)) as server:
        yield server


def sources(count: int) -> dict[str, dict]:
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()[:count]]
    return {row["sample_id"]: row for row in rows}


def conversation_spec(tmp_path: Path, demo_model: Path, count: int, **runner: object) -> Path:
    return write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "conv", "source": str(CONVERSATIONS), "limit": count, "mode": "all-turns",
                      "sampling": {"maxNewTokens": 10240}}], "out",
        runner={"concurrency": 16, "shardMaxSamples": 4, "shardMaxSeconds": 1, "maxAttempts": 8, **runner}))


def render(tokenizer, messages, tools) -> list[int]:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def test_conversations_regenerate_on_the_model_history_with_spliced_tool_results(tmp_path, sim, tokenizer,
                                                                                   demo_model):
    source = sources(24)
    summary = asyncio.run(run_spec(conversation_spec(tmp_path, demo_model, 24), [sim.url], str(tmp_path / "out")))
    storage = open_storage(str(tmp_path / "out"))
    rows = assert_exactly_once(storage, "conv", set(source))
    assert summary.datasets[0].generated == 24
    reasons = Counter(row["stop_reason"] for row in rows)
    assert set(reasons) <= set(STOP_REASONS)
    # the simulator matches the source's call most of the time (85 % per call) and diverges now and then
    assert reasons["complete"] >= 8 and reasons["tool_divergence"] + reasons["diverged_no_call"] >= 1, reasons
    for row in rows:
        messages, tools = source[row["sample_id"]]["messages"], source[row["sample_id"]]["tools"]
        turns = row["turns"]
        assert row["turn_count"] == len(turns) and row["completion_tokens"] == sum(len(t["output_ids"]) for t in turns)
        # turn 0 answers the system and first user message, rendered by the model's own template
        assert turns[0]["prompt_ids"] == render(tokenizer, messages[:2], tools) and turns[0]["history_exact"] is None
        for previous, turn in zip(turns, turns[1:], strict=False):
            text = tokenizer.decode(turn["prompt_ids"], skip_special_tokens=False)
            calls = json.loads(previous["tool_calls"] or "[]")
            answer_start = previous["output_ids"].index(tokenizer.convert_tokens_to_ids("</think>")) + 1 \
                if tokenizer.convert_tokens_to_ids("</think>") in previous["output_ids"] else 0
            said = tokenizer.decode(previous["output_ids"][answer_start:-1], skip_special_tokens=True)
            if not calls:
                assert said in text, "the model's own previous answer is in the history"
            for call in calls:  # the source's result follows, under the model's own call id
                assert f"## Return of {call['id']}\n" in text
            # the demo template drops reasoning from history answers, so the history is never a prefix extension
            assert turn["history_exact"] is False
        for message in messages:
            if message["role"] == "assistant" and message["content"] and len(turns) > 1:
                last = tokenizer.decode(turns[-1]["prompt_ids"], skip_special_tokens=False)
                assert message["content"] not in last, "a source answer never enters the history"
        if row["stop_reason"] == "complete":
            wanted = sum(m["role"] == "assistant" for m in messages) + (messages[-1]["role"] != "assistant")
            assert len(turns) == wanted
        elif row["stop_reason"] in ("tool_divergence", "diverged_no_call"):
            assert row["stop_detail"].startswith(f"turn {len(turns) - 1}: the model")
        units = list(units_from_row(row))
        assert [u.turn_index for u in units] == list(range(len(turns)))
        assert [u.prompt_ids for u in units] == [t["prompt_ids"] for t in turns]
    # the export yields one record per assistant turn, token-exact, each with its conversation's id
    subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "-q", "export", str(tmp_path / "out"),
                    str(tmp_path / "exp"), "--format", "speculators"], check=True, capture_output=True)
    records = {r["id"]: r for part in sorted((tmp_path / "exp" / "data").glob("*.jsonl"))
               for r in map(json.loads, part.read_text().splitlines())}
    assert len(records) == sum(row["turn_count"] for row in rows)
    for row in rows:
        for index, turn in enumerate(row["turns"]):
            record = records[f"conv/{row['sample_id']}#s0#t{index}"]
            assert record["input_ids"] == turn["prompt_ids"] + turn["output_ids"]
            assert record["primary_id"] == f"conv/{row['sample_id']}#s0"
            assert record["metadata"]["history_exact"] is (turn["history_exact"] is not False)
    markers = read_markers(storage, "conv")
    summaries = {sid: (n, r) for m in markers for sid, n, r in zip(m["samples"]["sample_id"],
                                                                    m["samples"]["turn_count"],
                                                                    m["samples"]["stop_reason"], strict=True)}
    assert summaries == {row["sample_id"]: (row["turn_count"], row["stop_reason"]) for row in rows}


def test_a_kill_mid_conversation_redoes_that_conversation_whole(tmp_path, sim, tokenizer, demo_model):
    source = sources(40)
    spec = conversation_spec(tmp_path, demo_model, 40, concurrency=8, shardMaxSamples=2)
    out = tmp_path / "out"
    storage = LocalStorage(out)
    # killed right after the 3rd commit: 6 conversations are committed, others are between two of their turns
    killed_at(run_cli(spec, out, sim.url, "kill-after:marker:3"), "kill-after:marker:3")
    before = {row["sample_id"]: row for row in read_committed_rows(storage, "conv")}
    assert 0 < len(before) < 40
    final = run_cli(spec, out, sim.url)
    assert final.returncode == EXIT_OK, final.stderr[-3000:]
    assert outcomes_per_line(storage, "conv") == Counter(range(1, 41)), "each conversation exactly one outcome"
    rows = assert_exactly_once(storage, "conv", set(source))
    for row in rows:
        messages, tools = source[row["sample_id"]]["messages"], source[row["sample_id"]]["tools"]
        assert row["turns"][0]["prompt_ids"] == render(tokenizer, messages[:2], tools), "redone from turn 0"
        assert row["stop_reason"] in STOP_REASONS
        if row["sample_id"] in before:
            assert row["turns"] == before[row["sample_id"]]["turns"], "a committed conversation is never redone"



class FailsLaterTurns:
    """Stands in for the client: answers first turns, and fails every later turn for good (as after its retries),
    so every conversation that gets past turn 0 fails mid-way."""

    def __init__(self, client, assistant_id: int) -> None:
        self.client, self.assistant_id = client, assistant_id

    async def generate(self, input_ids, sampling_params, seed_for=None, affinity=None):
        if input_ids.count(self.assistant_id) > 1:  # an earlier answer in the history, plus the generation prompt
            return GenerationFailure("retries_exhausted", "server error 503 (8 attempts)", 8)
        return await self.client.generate(input_ids, sampling_params, seed_for, affinity)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_request_failing_mid_conversation_fails_it_whole_and_retry_failed_redoes_it(tmp_path, sim, tokenizer,
                                                                                      demo_model):
    source = sources(12)
    spec = load_spec_file(conversation_spec(tmp_path, demo_model, 12)).spec
    out = str(tmp_path / "out")

    async def run(failing: bool, retry_failed: bool = False):
        runner = await prepare(RunnerConfig(spec=spec, servers=[sim.url], output_uri=out, retry_failed=retry_failed),
                               api_key=None)
        if failing:
            runner.client = FailsLaterTurns(runner.client, tokenizer.convert_tokens_to_ids("<|im_assistant|>"))
        return await runner.run()

    asyncio.run(run(True))
    storage = open_storage(out)
    rows = list(read_committed_rows(storage, "conv"))
    errors = committed_errors(storage, "conv")
    # a conversation that stopped at turn 0 (diverged there) is a row; every other one failed whole, no partial row
    assert all(row["turn_count"] == 1 for row in rows)
    assert {e["sample_id"] for e in errors} | {r["sample_id"] for r in rows} == set(source)
    assert errors and all(e["reason"] == "retries_exhausted" and "turn 1 of the conversation" in e["message"]
                          for e in errors)
    asyncio.run(run(False, retry_failed=True))
    final = {row["sample_id"]: row for row in assert_exactly_once(storage, "conv", set(source))}
    # Redone whole in retry round 1: each turn drawn with a seed of its own (not the failed round's), recorded with it.
    retried = [final[e["sample_id"]] for e in errors]
    for row in retried:
        turns = row["turns"]
        assert row["seed"] == turns[0]["seed"]
        assert all(turn["seed"] == sample_seed(None, "conv", row["line"], 0, attempt=turn["attempts"] - 1,
                                               retry_round=1, turn=number) for number, turn in enumerate(turns))
    assert any(row["turn_count"] > 1 for row in retried), "the simulator's answers now run past turn 0"


def test_a_turn_that_no_longer_fits_the_context_stops_the_conversation(tmp_path, sim, demo_model):
    # Turn 0 (the tools, a system and a user message: ~380 tokens) + 1000 fits 1400; the history grows past it.
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "conv", "source": str(CONVERSATIONS), "limit": 8, "mode": "all-turns",
                      "sampling": {"maxNewTokens": 1000}}], "out", server={"contextLength": 1400}))
    asyncio.run(run_spec(spec, [sim.url], str(tmp_path / "out")))
    rows = list(read_committed_rows(open_storage(str(tmp_path / "out")), "conv"))
    exceeded = [row for row in rows if row["stop_reason"] == "context_exceeded"]
    assert exceeded, Counter(row["stop_reason"] for row in rows)
    for row in exceeded:
        assert f"turn {row['turn_count']}:" in row["stop_detail"]
        assert all(t["prompt_tokens"] + 1000 <= 1400 for t in row["turns"])


def test_all_turns_on_a_family_without_a_tool_call_parser_is_refused_before_any_request(tmp_path: Path) -> None:
    import shutil

    from tests.reference.families import FIXTURES
    from tokenmill_runner.spec.resource import SpecError

    # The qwen3 fixture with a template that writes calls as <<call NAME ARGS>>, a form no parser of tokenmill reads.
    model = tmp_path / "acme"
    shutil.copytree(FIXTURES / "qwen3", model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["chat_template"] = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<<call {{ c.function.name }} {{ c.function.arguments | tojson }}>>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    spec = load_spec_file(write_spec(tmp_path / "spec.yaml", spec_document(model, [
        {"name": "chat", "source": str(CONVERSATIONS), "limit": 2},
        {"name": "agent", "source": str(CONVERSATIONS), "limit": 2, "mode": "all-turns"}], "out"))).spec
    out = tmp_path / "out"
    with pytest.raises(SpecError, match=r"dataset agent: mode all-turns .* model family qwen3 .*<<call get_weather"):
        # no server listens there: the refusal comes first
        asyncio.run(prepare(RunnerConfig(spec=spec, servers=["http://127.0.0.1:9"], output_uri=str(out)),
                            api_key=None))
    assert not (out / "run.json").exists()

"""Each model family's tokenizer, loaded by tokenmill, gives the ids the family's own code gives.

The reference is computed live by tests/reference/reference_ids.py in a separate virtualenv pinned the way SGLang's
image pins it (tests/reference/requirements.txt: transformers 4.57.1 of SGLang v0.5.9, the first release serving
Kimi-K2.5); tokenmill runs transformers 5 with its shims. A prompt the template rejects must be rejected by both.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.reference.families import FIXTURES, PROMPTS, VARIANTS, Variant
from tokenmill_runner.render import segments
from tokenmill_runner.render.pretokenize import PromptEncoder, TokenizerError, describe_tokenizer, load_tokenizer
from tokenmill_runner.source.prompts import Prompt, RowError


def prompts() -> list[Prompt]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [Prompt(i + 1, row["sample_id"], row["messages"], row.get("tools")) for i, row in enumerate(rows)]


@pytest.mark.parametrize("by_pieces", [False, True], ids=["checked", "by-pieces"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_prompt_ids_equal_the_family_reference(variant: Variant, by_pieces: bool, reference: dict,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways a fast tokenizer's prompts are encoded: a run's first texts, whole and checked against their pieces,
    and every later text, by its pieces between added tokens (render/segments.py)."""
    expected = reference["fixtures"][variant.name]["results"]
    tokenizer = load_tokenizer(str(variant.path), variant.trust_remote_code)
    if by_pieces:
        monkeypatch.setattr(segments, "CHECKED_TEXTS", 0)
    encoder = PromptEncoder(tokenizer)
    encoded = encoder.encode_batch(prompts(), variant.kwargs)
    if by_pieces and variant.family not in ("kimi-k2.5", "mistral-tekken"):  # their own code encodes, not Rust
        assert encoder._segments is not None and encoder._segments._trusted
    for prompt, ids in zip(prompts(), encoded, strict=True):
        want = expected[prompt.sample_id]
        if "error" in want:
            assert isinstance(ids, RowError) and ids.reason == "template_error", (prompt.sample_id, want)
        else:
            assert not isinstance(ids, RowError), (prompt.sample_id, ids)
            assert ids == want["ids"], f"{variant.name} / {prompt.sample_id}: first difference at " + str(
                next((i for i, (a, b) in enumerate(zip(ids, want["ids"], strict=False)) if a != b), min(len(ids), len(want["ids"]))))
    # Every family renders most of the prompt set; a fixture the reference cannot load at all is no proof.
    assert sum("ids" in r for r in expected.values()) >= len(expected) - 2


def test_reference_runs_the_pinned_transformers(reference: dict) -> None:
    assert reference["versions"]["transformers"] == "4.57.1"
    assert reference["fixtures"]["kimi-k2.5"]["loader"] == "TikTokenTokenizer"
    assert reference["fixtures"]["mistral-tekken"]["loader"] == "mistral_common"


def test_kimi_tools_are_declared_in_typescript_by_its_own_code() -> None:
    tokenizer = load_tokenizer(str(FIXTURES / "kimi-k2.5"), trust_remote_code=True)
    tools = next(p for p in prompts() if p.sample_id == "tools-no-system")
    text = tokenizer.apply_chat_template(tools.messages, tools=tools.tools, add_generation_prompt=True, tokenize=False)
    assert "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n" in text
    assert "type search_flights = (_: {\n" in text and "passengers?: number" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")


def test_kimi_remote_code_needs_the_bytes_to_unicode_shim_under_transformers_5(tmp_path) -> None:
    # The fixture imports bytes_to_unicode from transformers' gpt2 module, as Kimi's published code does; without
    # tokenmill's shim transformers 5 cannot import it.
    code = ("import transformers.models.gpt2.tokenization_gpt2 as m; from transformers import AutoTokenizer\n"
            f"AutoTokenizer.from_pretrained({str(FIXTURES / 'kimi-k2.5')!r}, trust_remote_code=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "bytes_to_unicode" in done.stderr


def test_remote_code_without_trust_names_the_field() -> None:
    with pytest.raises(TokenizerError, match=r"tokenization_kimi\.TikTokenTokenizer.*spec\.model\.trustRemoteCode"):
        load_tokenizer(str(FIXTURES / "kimi-k2.5"), trust_remote_code=False)


def test_a_folder_without_a_tokenizer_names_the_files_looked_for(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError) as raised:
        load_tokenizer(str(tmp_path))
    message = str(raised.value)
    for name in ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "tekken.json", "tokenizer.model",
                 "found config.json", "spec.model.tokenizer"):
        assert name in message


def test_kimi_reasoning_also_ends_at_the_tool_call_section() -> None:
    tokenizer = load_tokenizer(str(FIXTURES / "kimi-k2.5"), trust_remote_code=True)
    info = describe_tokenizer(tokenizer, "kimi", ["</think>"], None, str(FIXTURES / "kimi-k2.5"))
    assert list(info.reasoning_end_tokens.values()) == ["</think>", "<|tool_calls_section_begin|>"]
    assert info.reasoning_end_token == "</think>"
    explicit = describe_tokenizer(tokenizer, "kimi", ["</think>"], None, None, explicit_end_tokens=True)
    assert list(explicit.reasoning_end_tokens.values()) == ["</think>"]


def test_families_without_a_tool_section_keep_one_end_token() -> None:
    qwen = load_tokenizer(str(FIXTURES / "qwen3"))
    assert list(describe_tokenizer(qwen, "qwen3", ["</think>"], None, None).reasoning_end_tokens.values()) == [
        "</think>"]
    mistral = load_tokenizer(str(FIXTURES / "mistral-tekken"))
    info = describe_tokenizer(mistral, "mistral", ["[/THINK]"], None, str(FIXTURES / "mistral-tekken"))
    assert info.reasoning_end_id == mistral.encode("[/THINK]")[0] and info.eos_token_ids == [2]


def test_mistral_takes_no_chat_template_arguments() -> None:
    mistral = load_tokenizer(str(FIXTURES / "mistral-tekken"))
    [result] = PromptEncoder(mistral).encode_batch(prompts()[:1], {"thinking": True})
    assert isinstance(result, RowError) and "takes no chat template arguments" in result.message

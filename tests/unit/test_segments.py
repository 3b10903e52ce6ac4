"""A rendered prompt encoded by its pieces between added tokens gives the ids of the whole text, or is encoded whole.

tests/unit/test_tokenizer_families.py holds both ways to each family's reference ids on the prompt fixtures; these
tests take the texts where a cut could go wrong, and the tokenizers where cutting is not the same."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from tests.reference.families import FIXTURES
from tokenmill_runner.render import segments
from tokenmill_runner.render.pretokenize import load_tokenizer
from tokenmill_runner.render.segments import SegmentEncoder

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-model"


def whole(backend: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]


def edge_texts(added: list[str]) -> list[str]:
    """Added tokens at the start and the end, side by side, with whitespace and newlines around them, repeated,
    cut in half, inside words, and text with none."""
    first, second = added[0], added[-1]
    half = first[: len(first) // 2]
    return [
        "", " ", "\n\n", "plain text, no added token at all", first, first + second, f"{first}{first}{first}",
        f"{first}  leading spaces", f"trailing spaces  {second}", f" {first} \n{second}\n ", f"a{first}b{second}c",
        f"{half} is half a token {half}{first}", f"word{first}word", f"\t{first}\t\t{second}  \n",
        f"{first}system{second}\nYou are a careful assistant.{first}user{second}  Hi there!  {first}assistant",
        "é ü 中文 🙂 " + first + " emoji 🙂 " + second, f"{first}  {first}   {first}",
    ]


@pytest.mark.parametrize("family", ["demo", "qwen3", "llama-3.1", "gpt-oss", "deepseek-v3.2", "glm-4.5"])
def test_pieces_between_added_tokens_give_the_whole_text_s_ids(family: str) -> None:
    tokenizer = load_tokenizer(str(DEMO if family == "demo" else FIXTURES / family))
    backend = tokenizer.backend_tokenizer
    encoder = SegmentEncoder.for_backend(backend)
    assert encoder is not None
    added = sorted(encoder._ids, key=len)
    texts = edge_texts(added[-3:]) + edge_texts(added[:2])
    expected = whole(backend, texts)
    assert encoder._by_pieces(texts) == expected
    assert encoder._by_pieces(texts) == expected, "the same again, every piece now from the cache"
    assert encoder._by_pieces(list(reversed(texts))) == list(reversed(expected))


def test_a_token_that_strips_whitespace_beside_it_makes_the_tokenizer_encode_whole(caplog) -> None:
    backend = Tokenizer.from_str(load_tokenizer(str(DEMO)).backend_tokenizer.to_str())
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    texts = ["fill  <mask> in", "<mask>", "a <mask> b <mask>"] * 30
    assert SegmentEncoder.for_backend(backend) is None
    # Cut anyway, the pieces keep the spaces the token takes: why such a tokenizer is refused, and what the check
    # of a run's first texts catches for a rule the refusal does not know.
    forced = SegmentEncoder(backend, {t.content: n for n, t in backend.get_added_tokens_decoder().items()})
    assert forced._by_pieces(texts[:1]) != whole(backend, texts[:1])
    with caplog.at_level(logging.WARNING, logger="tokenmill_runner.render.segments"):
        assert forced.encode(texts) == whole(backend, texts)
    assert "encoded whole" in caplog.text and not forced._trusted
    assert forced.encode(texts) == whole(backend, texts), "after a difference, every text is encoded whole"


@pytest.mark.parametrize("why", ["metaspace", "split-special-tokens", "no-added-tokens"])
def test_tokenizers_whose_pieces_depend_on_their_place_are_encoded_whole(why: str) -> None:
    backend = Tokenizer(models.BPE())
    if why == "metaspace":  # prepend_scheme "first" gives the text's first piece a space the others lack
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if why != "no-added-tokens":
        backend.add_special_tokens(["<s>", "</s>"])
    if why == "split-special-tokens":
        backend.encode_special_tokens = True
    assert SegmentEncoder.for_backend(backend) is None


def test_the_cache_of_pieces_stays_within_its_bound_and_the_ids_stay_exact(monkeypatch) -> None:
    monkeypatch.setattr(segments, "CACHE_IDS", 200)
    monkeypatch.setattr(segments, "CHECKED_TEXTS", 0)
    backend = load_tokenizer(str(DEMO)).backend_tokenizer
    encoder = SegmentEncoder.for_backend(backend)
    assert encoder is not None
    token = max(encoder._ids, key=len)
    texts = [f"{token}shared system prompt{token}question number {i} " * (1 + i % 3) for i in range(300)]
    for start in range(0, len(texts), 16):
        batch = texts[start:start + 16]
        assert encoder.encode(batch) == whole(backend, batch)
        assert encoder._kept <= 200 and sum(len(ids) for ids in encoder._pieces.values()) == encoder._kept
    # A piece of more ids than the whole cache holds is encoded and never kept.
    long = f"{token}{'x y ' * 250}{token}"
    assert encoder.encode([long]) == whole(backend, [long]) and "x y " * 250 not in encoder._pieces

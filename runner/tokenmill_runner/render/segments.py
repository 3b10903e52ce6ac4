"""Rendered prompts encoded a piece at a time: the text between two added tokens is encoded once per distinct piece.

A chat's scaffolding repeats across prompts (role names, a shared system prompt, the tools' declaration, a few-shot
preamble), each between added tokens such as <|im_start|> and <|im_end|>. The Rust tokenizer cuts a text at its added
tokens before anything else and normalizes, pre-tokenizes and encodes each piece on its own (tokenizers'
AddedVocabulary::extract_and_normalize, then PreTokenizedString per split), so a text's ids are the ids of its pieces
in order, each added token its own id. That holds where no piece's encoding depends on what is around it:
- no added token strips the whitespace beside it (lstrip, rstrip), matches only as a whole word (single_word), or is
  matched after normalization (normalized): then the cut is exactly where the token's text occurs, leftmost and
  longest first, as the tokenizer's Aho-Corasick matcher cuts;
- added tokens are matched at all (`encode_special_tokens` off);
- no Metaspace pre-tokenizer, whose prepend_scheme "first" treats the text's first piece apart;
- no BPE dropout.
Any other tokenizer is encoded whole (`SegmentEncoder.for_backend` gives None). And the first texts of a run are
encoded both ways and compared (`encode`): one difference and the encoder encodes every text whole from then on.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

logger = logging.getLogger(__name__)

# The pieces kept: at most this many of their ids in all (~36 bytes an id as Python ints: under 10 MB, plus the
# pieces' text, about 4 characters an id); past it the cache starts again, so a source of unique long prompts costs
# a lookup a piece, never memory.
CACHE_IDS = 1 << 18
CHECKED_TEXTS = 64  # texts encoded both ways before the pieces are trusted


def _has_metaspace(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "Metaspace" or any(_has_metaspace(value) for value in node.values())
    if isinstance(node, list):
        return any(_has_metaspace(value) for value in node)
    return False


class SegmentEncoder:
    """`encode(texts)`: the ids the backend's encode_batch_fast(texts, add_special_tokens=False) gives."""

    def __init__(self, backend: Any, added: dict[str, int]) -> None:
        self._backend = backend
        self._ids = added
        # Longest first: at the leftmost position a token occurs, the longest one there is cut (leftmost-longest).
        self._cut = re.compile("(" + "|".join(re.escape(text) for text in sorted(added, key=len, reverse=True)) + ")")
        self._pieces: dict[str, list[int]] = {}
        self._kept = 0  # ids in the cache
        self._checked = 0
        self._trusted = True
        self._lock = threading.Lock()  # the check's count and the cache's filling; reads take the dict as it is

    @classmethod
    def for_backend(cls, backend: Any) -> SegmentEncoder | None:
        """The encoder for a Rust tokenizer whose pieces encode on their own (see the module's doc), else None."""
        try:
            decoder = backend.get_added_tokens_decoder()
            if getattr(backend, "encode_special_tokens", True) or not decoder:
                return None
            if any(token.lstrip or token.rstrip or token.single_word or token.normalized or not token.content
                   for token in decoder.values()):
                return None
            pre = backend.pre_tokenizer
            if pre is not None and _has_metaspace(json.loads(pre.__getstate__())):
                return None
            if getattr(backend.model, "dropout", None):
                return None
        except (AttributeError, TypeError, ValueError) as error:  # a backend of another shape: encode texts whole
            logger.debug("encoding texts whole: %s", error)
            return None
        return cls(backend, {token.content: int(number) for number, token in decoder.items()})

    def encode(self, texts: list[str]) -> list[list[int]]:
        with self._lock:
            checking = self._trusted and self._checked < CHECKED_TEXTS
            if checking:
                self._checked += len(texts)
        if not self._trusted or checking:
            whole = [encoding.ids for encoding in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
            if checking and self._by_pieces(texts) != whole:
                self._trusted = False
                logger.warning("this tokenizer encodes a text otherwise than its pieces between added tokens: "
                               "every prompt is encoded whole")
            return whole
        return self._by_pieces(texts)

    def _by_pieces(self, texts: list[str]) -> list[list[int]]:
        cut = [self._cut.split(text) for text in texts]  # pieces at even places, added tokens at odd ones
        known = self._pieces
        found: dict[str, list[int]] = {}  # this call's pieces: another thread may start the cache again meanwhile
        missing: list[str] = []
        for parts in cut:
            for piece in parts[::2]:
                if piece and piece not in found:
                    cached = known.get(piece)
                    if cached is None:
                        missing.append(piece)
                        found[piece] = []
                    else:
                        found[piece] = cached
        if missing:
            for piece, encoding in zip(missing, self._backend.encode_batch_fast(missing, add_special_tokens=False),
                                       strict=True):
                found[piece] = encoding.ids
            with self._lock:
                self._keep(missing, found)
        out = []
        for parts in cut:
            ids: list[int] = []
            for place, part in enumerate(parts):
                if place % 2:
                    ids.append(self._ids[part])
                elif part:
                    ids += found[part]
            out.append(ids)
        return out

    def _keep(self, pieces: list[str], found: dict[str, list[int]]) -> None:
        ids = sum(len(found[piece]) for piece in pieces)
        if self._kept + ids > CACHE_IDS:
            self._pieces = {}
            self._kept = 0
        if ids <= CACHE_IDS:
            self._pieces.update((piece, found[piece]) for piece in pieces)
            self._kept += ids

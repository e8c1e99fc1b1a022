"""The text each token writes: the detokenizer specd's output goes through,
and each id's bytes for the grammar engine.

llguidance reads a Hugging Face tokenizer itself only when its decoder is
byte-level (GPT-2 style) or a SentencePiece sequence with byte fallback; any
other decoder (a plain `Fuse`, `WordPiece`, `Metaspace`, a `Sequence` without
`ByteFallback`, a slow tokenizer) it refuses. For those, `token_bytes` derives
each id's bytes from the vocabulary itself: what the id adds to the decoded
text, read through the same decoder the output is (`text_decoder`), after a
few different tokens. A decoder whose text is not the concatenation of its
tokens' texts (one that drops or merges characters depending on the
neighbours, e.g. transformers' clean-up of " ." after a space) has no such
bytes: `TokenizerUnsupported` names the token that shows it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

from specd_core.errors import Unsupported

# Texts whose last token each precedes every id once: a letter, a space and a
# punctuation mark, so that a decoder that treats a token differently after
# one of them (a space dropped, a space added) is caught.
ANCHOR_TEXTS = ("a", " ", ".")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPECIAL_MARKER = b"\xff"  # llguidance's first byte of a special token's name: never in text


class TokenizerUnsupported(Unsupported):
    """Structured output cannot run over this tokenizer (FAILED_PRECONDITION)."""


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text without special tokens, as tokenizer.decode gives it. A
    fast (Rust) tokenizer's own decode when transformers would add nothing to
    it: its wrapper converts and checks the ids on every call, which is most of
    the cost of a window of a few ids, paid twice per token. transformers
    applies clean_up_tokenization only to non-BPE models."""
    backend = getattr(tokenizer, "_tokenizer", None)
    bpe = backend is not None and type(backend.model).__name__ == "BPE"
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if backend is not None and (not getattr(tokenizer, "clean_up_tokenization_spaces", False) or (bpe and not forced)):
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def special_ids(tokenizer) -> set[int]:
    """Ids that write no text (skipped by the decoder): control tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {int(i) for i in tokenizer.all_special_ids} | {int(i) for i, t in added.items() if t.special}


def _decoder_kinds(tokenizer) -> set[str]:
    """The types of the fast tokenizer's decoder and of the decoders in it."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or backend.decoder is None:
        return set()
    spec = json.loads(backend.to_str()).get("decoder") or {}
    return {spec.get("type", "")} | {d.get("type", "") for d in spec.get("decoders", [])}


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _raw_bytes(piece: str | None, kinds: set[str]) -> bytes | None:
    """A token's bytes from its vocabulary entry, for a piece that is part of
    a UTF-8 character (its text alone is U+FFFD): a byte-fallback `<0xNN>`, or
    a byte-level piece. None when the decoder has neither."""
    if piece is None:
        return None
    if "ByteFallback" in kinds and (m := _BYTE_TOKEN.fullmatch(piece)):
        return bytes([int(m.group(1), 16)])
    if "ByteLevel" in kinds:
        chars = _byte_level_chars()
        if all(c in chars for c in piece):
            return bytes(chars[c] for c in piece)
    return None


def _anchors(tokenizer, specials: set[int]) -> list[int]:
    ids = []
    for text in ANCHOR_TEXTS:
        encoded = [i for i in tokenizer.encode(text, add_special_tokens=False) if i not in specials]
        if encoded and encoded[-1] not in ids:
            ids.append(encoded[-1])
    if not ids:
        raise TokenizerUnsupported(
            f"structured output is unavailable: the tokenizer encodes none of {list(ANCHOR_TEXTS)} as text"
        )
    return ids


def _contribution(decode, anchors: list[int], heads: list[str], token: int) -> str:
    """The text `token` adds after each anchor, the same after every one."""
    seen: list[str] = []
    for anchor, head in zip(anchors, heads):
        text = decode([anchor, token])
        if not text.startswith(head) or (seen and text[len(head) :] != seen[0]):
            raise TokenizerUnsupported(
                "structured output is unavailable: this tokenizer's decoded text is not the concatenation of its "
                f"tokens' texts ({head!r} then token {token} decode as {text!r}"
                + (f", but {heads[0]!r} then it as {heads[0] + seen[0]!r})" if seen else ")")
            )
        seen.append(text[len(head) :])
    return seen[0]


def _one_token(decode, anchors: list[int], heads: list[str], token: int, piece: str | None, kinds: set[str]) -> bytes:
    # A piece that is part of a UTF-8 character decodes as U+FFFD (one per
    # byte, or merged with a neighbour's bytes): its bytes come from the
    # vocabulary entry instead.
    if "\ufffd" not in (piece or "") and any("\ufffd" in decode([a, token]) for a in anchors):
        raw = _raw_bytes(piece, kinds)
        if raw is None:
            raise TokenizerUnsupported(
                f"structured output is unavailable: token {token} ({piece!r}) writes part of a character, "
                "and the tokenizer's decoder says of no byte it stands for"
            )
        return raw
    return _contribution(decode, anchors, heads, token).encode()


def token_bytes(tokenizer) -> list[bytes]:
    """Each id's bytes as the grammar engine needs them: what it adds to the
    decoded text; a special token's name behind SPECIAL_MARKER (it writes no
    text, and the engine allows it only where the grammar names it, e.g. EOS).
    TokenizerUnsupported when some id has no such bytes."""
    decode, specials, kinds = text_decoder(tokenizer), special_ids(tokenizer), _decoder_kinds(tokenizer)
    anchors = _anchors(tokenizer, specials)
    heads = [decode([a]) for a in anchors]
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    out = []
    for token, piece in enumerate(pieces):
        if token in specials:
            out.append(SPECIAL_MARKER + str(piece or "").encode())
            continue
        out.append(_one_token(decode, anchors, heads, token, piece, kinds))
    return out

"""Encoded text, decoded before the injection check. An instruction hidden in base64, base32, hex,
invisible Unicode tag characters, ROT13 or written backwards is noise to the classifier, while the
model it is meant for may well decode and obey it. So each such span is replaced by the text it
encodes (`revealed`), and each sentence in ROT13 or backwards by its plain reading
(`unscrambled`), and the classifier reads that. A span that decodes to no text (a hash, a key, a
signature) stays as it is; so does everything else.

The scans run on RE2 (linear in the text, like the PII patterns): a 4 MiB body costs one pass per
encoding. Sentences are unscrambled as the classifier reads them, so at most MAX_CHUNKS of them."""

from __future__ import annotations

import base64
import binascii
import codecs
import re
from collections.abc import Callable

import re2

DEPTH = 2  # decode what a decoded span holds, once more (base64 of hex, say)
MIN_LETTERS = 4
PRINTABLE_SHARE = 0.95
WORDS_NEEDED = 3  # a ROT13 or reversed span is judged by at least this many words
KNOWN_SHARE, KNOWN_GAIN = 0.7, 0.4  # ... and decoded when this share of them is known, this much more

# U+E0020..U+E007E mirror ASCII as invisible "tag" characters; the rest of the block carries nothing
TAGS = {cp: (chr(cp - 0xE0000) if 0x20 <= cp - 0xE0000 <= 0x7E else None) for cp in range(0xE0000, 0xE0080)}
INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u2060\ufeff"))  # soft hyphen, zero widths
# ｉｇｎｏｒｅ -> ignore; full-width punctuation is how Chinese and Japanese are written, and stays
FULLWIDTH = {cp: chr(cp - 0xFEE0) for cp in range(0xFF10, 0xFF5B) if chr(cp - 0xFEE0).isalnum()}

HEX = re2.compile(r"\b(?:[0-9A-Fa-f]{2}[ :]?){12,}\b|(?:\\x[0-9A-Fa-f]{2}){8,}")
BASE32 = re2.compile(r"\b[A-Z2-7]{16,}=*")
BASE64 = re2.compile(r"[A-Za-z0-9+/_-]{12,}={0,2}")
WORD = re.compile(r"[A-Za-z]{2,}")
JUDGED_CHARACTERS = 256  # a sentence is judged by its first words


def revealed(text: str, depth: int = DEPTH) -> str:
    """`text` with every encoded span replaced by what it says."""
    text = text.translate(TAGS).translate(INVISIBLE).translate(FULLWIDTH)
    for pattern, decode in ((HEX, _hex), (BASE32, _base32), (BASE64, _base64)):
        text = pattern.subn(lambda m, decode=decode: _decoded(m.group(), decode, depth), text)[0]
    return text


def _decoded(span: str, decode: Callable[[str], bytes], depth: int) -> str:
    try:
        data = decode(span)
        plain = data.decode("utf-8")
    except (ValueError, binascii.Error):  # UnicodeDecodeError is a ValueError
        return span
    if not _is_text(plain):
        return span
    return revealed(plain, depth - 1) if depth > 1 else plain


def _hex(span: str) -> bytes:
    return bytes.fromhex(span.replace("\\x", "").replace(":", "").replace(" ", ""))


def _base32(span: str) -> bytes:
    span = span.rstrip("=")
    return base64.b32decode(span + "=" * (-len(span) % 8))


def _base64(span: str) -> bytes:
    span = span.rstrip("=")
    return base64.b64decode(span + "=" * (-len(span) % 4), altchars=b"-_" if "-" in span or "_" in span else None,
                            validate=True)


def _is_text(plain: str) -> bool:
    """Mostly printable, with letters: what a message says, not what a hash or a key is."""
    printable = sum(c.isprintable() or c.isspace() for c in plain)
    return printable >= PRINTABLE_SHARE * len(plain) and sum(c.isalpha() for c in plain) >= MIN_LETTERS


def unscrambled(sentence: str, words: frozenset[str]) -> str:
    """The sentence, or its ROT13 or its reversal where that reads as far more known words.
    `words`: known lower-case words (a vocabulary). Judged on the sentence's first words."""
    head = sentence[:JUDGED_CHARACTERS]
    known = _known_share(head, words)
    if known is None or known >= KNOWN_SHARE:
        return sentence
    for read, plain in ((codecs.encode(head, "rot13"), lambda: codecs.encode(sentence, "rot13")),
                        (sentence[-JUDGED_CHARACTERS:][::-1], lambda: sentence[::-1])):
        share = _known_share(read, words)
        if share is not None and share >= max(KNOWN_SHARE, known + KNOWN_GAIN):
            return plain()
    return sentence


def _known_share(text: str, words: frozenset[str]) -> float | None:
    found = [w.lower() for w in WORD.findall(text)]
    return sum(w in words for w in found) / len(found) if len(found) >= WORDS_NEEDED else None

"""PII and secret detection and redaction: e-mail addresses, phone numbers, payment cards (Luhn),
IBANs (mod-97), IP addresses and API keys or tokens of common providers.

Redaction replaces each finding with a placeholder such as `[EMAIL_1]`; the same value gets the same
placeholder within a request, so a caller configured for reversible redaction can have its own
values put back into the answer. `StreamRedactor` does the same over a stream of text pieces and
never emits a secret even when it arrives split across chunks.

The patterns run on RE2 (google-re2), whose matching time is linear in the text: with Python's
backtracking `re`, the e-mail pattern took quadratic time on "a.a.a…" and the IPv6 one
exponential time on "1::aaaa…g" (0.28 s at 24 characters), so one request could stall a server.
RE2 has no lookaround; `PIIKind.isolated` checks the characters around a match instead.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import re2


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _card(match: str) -> bool:
    digits = re.sub(r"[ -]", "", match)
    return 13 <= len(digits) <= 19 and _luhn(digits)


def _iban(match: str) -> bool:
    compact = match.replace(" ", "").upper()
    rearranged = compact[4:] + compact[:4]
    return 15 <= len(compact) <= 34 and int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


def _ip(match: str) -> bool:
    try:
        ipaddress.ip_address(match)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class PIIKind:
    name: str
    pattern: re2._Regexp
    valid: Callable[[str], bool] = lambda _: True  # a check that cuts false positives (Luhn, mod-97)
    isolated: bool = False  # no word character (or "+") may touch the match on either side


KINDS = [
    # Secrets first: they may contain digit runs that look like other kinds.
    PIIKind("API_KEY", re2.compile(
        r"\b(?:sk-(?:proj-|ant-(?:api\d\d-)?)?[A-Za-z0-9_\-]{20,}"   # OpenAI, Anthropic
        r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"              # Stripe
        r"|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,}"  # GitHub
        r"|xox[abposr]-[A-Za-z0-9-]{10,}"                            # Slack
        r"|AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}"                        # AWS access key ids
        r"|AIza[0-9A-Za-z_\-]{35}"                                   # Google
        r"|hf_[A-Za-z0-9]{30,}"                                      # Hugging Face
        r"|glpat-[A-Za-z0-9_\-]{20,}"                                # GitLab
        r"|eyJ[A-Za-z0-9_\-]{10,}\.eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,})"  # JWTs
    )),
    PIIKind("EMAIL", re2.compile(r"\b[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}\b")),
    PIIKind("IBAN", re2.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b"), _iban),
    PIIKind("CARD", re2.compile(r"\b\d(?:[ -]?\d){12,18}\b"), _card),
    PIIKind("IP", re2.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b|\b(?:[0-9A-Fa-f]{1,4}:){2,7}[0-9A-Fa-f]{0,4}\b"
                             r"|\b(?:[0-9A-Fa-f]{1,4}:)+:(?:[0-9A-Fa-f]{1,4}:?)*\b"), _ip),
    PIIKind("PHONE", re2.compile(r"\+?\d{1,3}[ .\-]?\(?\d{2,4}\)?(?:[ .\-]?\d{2,4}){2,3}"),
            lambda m: 9 <= sum(c.isdigit() for c in m) <= 15, isolated=True),
]

# The stream holds back this many characters: more than any finding that contains spaces (an IBAN
# in groups is at most 42). Findings without spaces (keys, tokens, e-mails) are safe at any length,
# because the stream only ever cuts at a space or after a character outside ASCII, never inside a
# word still growing.
HOLDBACK_CHARS = 48


@dataclass(frozen=True)
class Finding:
    kind: str
    start: int
    end: int
    text: str


def find_pii(text: str) -> list[Finding]:
    """Non-overlapping findings, earliest first; earlier kinds in KINDS win overlaps. Linear in
    the text (RE2) and in the findings (one merge per kind)."""
    findings: list[Finding] = []  # sorted by start, never overlapping
    for kind in KINDS:
        found = [Finding(kind.name, m.start(), m.end(), m.group()) for m in kind.pattern.finditer(text)]
        findings = _merge(findings, [f for f in found if not (kind.isolated and _touches_word(text, f.start, f.end))
                                     and kind.valid(f.text)])
    return findings


def _merge(findings: list[Finding], candidates: list[Finding]) -> list[Finding]:
    """Both sorted and each free of overlaps: the findings, and the candidates that overlap none."""
    merged, i = [], 0
    for candidate in candidates:
        while i < len(findings) and findings[i].end <= candidate.start:
            merged.append(findings[i])
            i += 1
        if i == len(findings) or findings[i].start >= candidate.end:
            merged.append(candidate)
    return merged + findings[i:]


def _touches_word(text: str, start: int, end: int) -> bool:
    """An ASCII letter or digit (or _ +) next to the match: Chinese and Japanese write numbers right
    after words ("电话13812345678"), and a stream cut after such a character must scan the same."""
    before = text[start - 1] if start else " "
    after = text[end] if end < len(text) else " "
    return (before.isascii() and (before.isalnum() or before in "_+")
            or after.isascii() and (after.isalnum() or after == "_"))


@dataclass
class Redactor:
    """Placeholders per request: the same value always gets the same placeholder."""

    placeholders: dict[str, str] = field(default_factory=dict)  # value -> placeholder
    counts: dict[str, int] = field(default_factory=dict)

    def redact(self, text: str, findings: list[Finding] | None = None) -> str:
        findings = find_pii(text) if findings is None else findings
        pieces, position = [], 0
        for f in findings:
            placeholder = self.placeholders.get(f.text)
            if placeholder is None:
                self.counts[f.kind] = self.counts.get(f.kind, 0) + 1
                placeholder = self.placeholders[f.text] = f"[{f.kind}_{self.counts[f.kind]}]"
            pieces += [text[position:f.start], placeholder]
            position = f.end
        pieces.append(text[position:])
        return "".join(pieces)

    def restore(self, text: str) -> str:
        """The caller's own values back in place of their placeholders (reversible redaction)."""
        for value, placeholder in self.placeholders.items():
            text = text.replace(placeholder, value)
        return text


class StreamRedactor:
    """Redacts a text stream piece by piece. It holds back the last HOLDBACK_CHARS characters, any
    finding that reaches into them and the word being written, so a secret split across pieces is
    seen whole before anything of it is emitted."""

    def __init__(self, transform: Callable[[str, list[Finding]], str]) -> None:
        self.transform = transform  # (text, findings in it) -> text to emit
        self.pending = ""
        self.findings: list[Finding] = []

    def feed(self, piece: str) -> str:
        self.pending += piece
        cut = len(self.pending) - HOLDBACK_CHARS
        if cut <= 0:
            return ""
        findings = find_pii(self.pending)
        while cut > 0:
            moved = cut
            for f in reversed(findings):  # latest first: a moved cut is checked against every earlier finding
                if f.start < moved < f.end:
                    moved = f.start
            moved = self._quiet_point(moved)
            if moved == cut:
                break
            cut = moved
        return self._emit(cut, [f for f in findings if f.end <= cut])

    def _quiet_point(self, cut: int) -> int:
        """Back to a point no finding can span, so that the text after it scans as it would in
        context: after a space that ends a word which is not a number (digit groups such as card
        numbers are never split), or after a character outside ASCII, which no pattern matches
        (Chinese or Japanese text has no spaces, and would otherwise wait for the end)."""
        text = self.pending
        while cut > 0 and not (not text[cut - 1].isascii() and not text[cut - 1].isspace()
                               or text[cut - 1].isspace() and cut >= 2 and not text[cut - 2].isspace()
                               and not text[cut - 2].isdigit()):
            cut -= 1
        return cut

    def flush(self) -> str:
        return self._emit(len(self.pending), find_pii(self.pending))

    def _emit(self, cut: int, findings: list[Finding]) -> str:
        text, self.pending = self.pending[:cut], self.pending[cut:]
        self.findings += findings
        return self.transform(text, findings) if text else ""

"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of recent tokens and emitting what the newest token
added, so multi-byte characters split across tokens are held back until complete (the window's
text ends in U+FFFD until then). Stop strings are matched in the accumulated text, so they may
span token boundaries; the last (longest stop - 1) characters are held back while generating so
a stop string is never partly emitted.
"""

from __future__ import annotations

import functools

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens (leading-space rules)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not tokenizer.clean_up_tokenization_spaces:
            # the text tokenizer.decode gives, without its Python wrapper: a quarter of the cost
            self._decode = functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
        else:
            self._decode = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._text = ""  # everything decoded so far, up to a stop string if one matched
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.stop_reason: str | None = None

    def add_token(self, token_id: int, check_stop: bool = True) -> bool:
        """Decode one more token; True if a stop string matched (the request should stop).
        `check_stop` False (before min_tokens): stop strings in its text do not count."""
        self._tokens.append(token_id)
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        old_length = len(self._text)
        self._text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return check_stop and self._match_stop(old_length)

    def _match_stop(self, old_length: int) -> bool:
        for stop in self.stop:
            at = self._text.find(stop, max(0, old_length - len(stop) + 1))
            if at != -1:
                self._text = self._text[: at + len(stop) if self.include_stop else at]
                self.stop_reason = stop
                return True
        return False

    def output_text(self, finished: bool) -> str:
        """Text safe to show: all of it once finished, else minus a possible partial stop string."""
        if finished or not self._hold:
            return self._text
        return self._text[: max(0, len(self._text) - self._hold)]

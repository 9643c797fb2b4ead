"""Reasoning models' thinking, kept apart from their answer: `--reasoning-parser qwen3|deepseek_r1`.

Such models write their thinking between <think> and </think>, then the answer. With a parser on,
a chat answer's thinking goes to `reasoning_content` (vLLM's and DeepSeek's field) and only what
follows </think> to `content`, where tool calls are then looked for. Both parsers read the same
markers; they differ in where an answer starts:
- qwen3: in the answer, unless it opens with <think> (Qwen3's hybrid template, which with
  `chat_template_kwargs: {"enable_thinking": false}` writes an empty think block into the prompt);
- deepseek_r1: in the thinking (DeepSeek-R1's and Qwen3-2507 Thinking's templates open <think> in
  the prompt), which an opening <think> may repeat.
An answer that ends while thinking has its whole text as reasoning and no content.

A constraint (`response_format`, a required tool call) applies from after the thinking: the
answer thinks freely, then writes what the constraint allows (`thinking_before`). Where the prompt
has closed the thinking (`enable_thinking: false`), or the markers are not single tokens, it
applies from the first token.

Whole answers go through the same stream as streamed ones (`split`), so the two never differ.
Newlines right after a marker and before </think> are dropped, as the templates write them. Where
</think> is one token of the vocabulary, usage counts the thinking's tokens (`num_tokens`) as
OpenAI's `completion_tokens_details.reasoning_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hyperserve.sampling_params import Thinking

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")
CLOSING_TAIL_TOKENS = 8  # a prompt's thinking is closed if at most these many tokens, blank, follow </think>


@dataclass
class ReasoningStream:
    """Splits an answer's text, fed piece by piece, into (reasoning, content) pieces. Holds back
    what could still be the start of a marker, or newlines that may precede </think>."""

    starts_thinking: bool
    state: str = "start"  # "start" (an opening <think> may come), "thinking", "answer"
    thought: bool = False  # whether the answer began in thinking (a whole answer's reasoning is then not None)
    held: str = ""
    at_section_start: bool = True  # nothing of the current section emitted yet: newlines dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning, content = [], []
        self.held += text
        while True:
            if self.state == "start":
                stripped = self.held.lstrip()
                if stripped.startswith(START):
                    self.held, self.state = stripped[len(START):], "thinking"
                elif START.startswith(stripped) and not final:
                    break  # could still become <think>
                else:
                    self.state = "thinking" if self.starts_thinking else "answer"
                self.thought = self.state == "thinking"
                continue
            if self.state == "thinking":
                end = self.held.find(END)
                if end >= 0:
                    reasoning.append(self._section(self.held[:end].rstrip("\n")))
                    self.held, self.state, self.at_section_start = self.held[end + len(END):], "answer", True
                    continue
                keep = 0 if final else _partial_marker(self.held, END)
                body = self.held[: len(self.held) - keep]
                kept_newlines = 0 if final else len(body) - len(body.rstrip("\n"))
                reasoning.append(self._section(body[: len(body) - kept_newlines]))
                self.held = self.held[len(body) - kept_newlines:]
                break
            content.append(self._section(self.held))
            self.held = ""
            break
        return "".join(reasoning), "".join(content)

    def _section(self, text: str) -> str:
        if self.at_section_start:
            text = text.lstrip("\n")
            self.at_section_start = not text
        return text


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at text's end could begin `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def stream(parser: str) -> ReasoningStream:
    if parser not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {PARSERS}, got {parser!r}")
    return ReasoningStream(starts_thinking=parser == "deepseek_r1")


def num_tokens(parser: str, text: str, token_ids: list[int], end_id: int) -> int:
    """How many of an answer's tokens are its thinking, </think> (token `end_id`, one token of the
    vocabulary in Qwen3's and DeepSeek-R1's) included: all of them if it never closed."""
    if split(parser, text)[0] is None:
        return 0
    return token_ids.index(end_id) + 1 if end_id in token_ids else len(token_ids)


def split(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning, or None where the answer had none; content) of a whole answer."""
    whole = stream(parser)
    reasoning, content = whole.feed(text, final=True)
    return (reasoning if whole.thought else None), content


def thinking_before(parser: str, prompt_ids: list[int], start_id: int, end_id: int,
                    decode: Callable[[list[int]], str]) -> Thinking | None:
    """How a constrained answer to this prompt may think first: None where the prompt closed the
    thinking (</think> and blank text at its end, as Qwen3's template writes for
    enable_thinking false); opened by the prompt where its last marker is <think> (DeepSeek-R1's
    template), or where the parser says answers start thinking."""
    opened, closed = _last_index(prompt_ids, start_id), _last_index(prompt_ids, end_id)
    if opened > closed:
        return Thinking(start_id, end_id, open=True)
    tail = prompt_ids[closed + 1:]
    if closed >= 0 and len(tail) <= CLOSING_TAIL_TOKENS and not decode(tail).strip():
        return None
    return Thinking(start_id, end_id, open=parser == "deepseek_r1")


def _last_index(ids: list[int], token: int) -> int:
    """Where `token` last occurs in ids (-1: nowhere), searched at C speed from the end."""
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1

"""GPT-OSS's answers in OpenAI's harmony format, read into a chat answer's reasoning_content,
content and tool_calls.

An answer is a run of messages. Each has a header and a body,

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(the last two lines one), the first one's `<|start|>assistant` being the prompt's last tokens. A
body ends at <|end|> (another message follows), <|return|> (the answer is done) or <|call|> (a
tool is called). The channel says whose the text is: `analysis` is the model's thinking
(reasoning_content); `final` is the answer (content); `commentary` addressed
`to=functions.NAME` is a call to a function offered (its body the JSON arguments), and without a
recipient a preamble the user may see (content). The recipient may also come before the channel,
in the role's part of the header.

The markers are special tokens, so these answers are detokenized with them (skip_special_tokens
false) and the markers are dropped here. Whole answers go through the same stream as streamed ones,
so the two never differ. A constraint (response_format, a named tool_choice) applies to a body
whose header the prompt writes (`header_for`): the model then writes the body alone. With
tool_choice "required" and several functions the prompt writes the header up to the recipient's
`functions.`, and a grammar has the model name one of them and write its arguments' body.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hyperserve.engine.structured_output import JSON_LAYOUT
from hyperserve.sampling_params import StructuredOutputs
from hyperserve.server.protocol import NamedToolChoice, Tool
from hyperserve.server.tool_calls import one_per_call, whole_calls
from hyperserve.server.tools import HERMES, arguments_schema

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
CLOSERS = (END, RETURN, CALL, START)  # what ends a body (a model that skips <|end|> starts the next message)
MARKERS = (START, END, MESSAGE, CHANNEL, RETURN, CALL)
FUNCTIONS = "functions."
CALL_HEADER = f"{CHANNEL}commentary to={FUNCTIONS}"  # a call's header, up to the function's name
MAX_HEADER = 512  # characters before <|message|> past which a "header" is read as plain text

_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def speaks(tokenizer) -> bool:
    """Whether a tokenizer's model writes harmony: its markers are tokens of its vocabulary."""
    added = tokenizer.get_added_vocab() if tokenizer is not None else {}
    return all(marker in added for marker in (START, END, MESSAGE, CHANNEL))


def header_for(function: str | None = None) -> str:
    """The header a prompt writes for the body a constraint then shapes: the final answer's, or
    a call to `function` (its arguments as JSON)."""
    if function is None:
        return f"{CHANNEL}final{MESSAGE}"
    return f"{CALL_HEADER}{function} {CONSTRAIN}json{MESSAGE}"


@dataclass(frozen=True)
class HarmonyParser:
    """How a chat request's harmony answers are read: the functions it offered, and the header its
    prompt wrote (header_for), if it wrote one."""

    tool_names: frozenset[str] = frozenset()
    prompt_header: str = ""

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self.tool_names, self.prompt_header)

    def split(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(reasoning or None, content or None, tool calls) of a whole answer."""
        stream = self.stream()
        reasoning, content, _ = stream.feed(text, final=True)
        calls = whole_calls(stream.calls)
        return (reasoning if stream.thought else None), (content or None if calls else content), calls


@dataclass
class HarmonyStream:
    """Splits an answer's text, fed piece by piece, into reasoning, content and OpenAI's tool-call
    deltas. Holds back only what could still be a marker, or a header not yet whole."""

    tool_names: frozenset[str] = frozenset()
    held: str = ""  # to start with: the header the prompt wrote (header_for), if it wrote one
    kind: str | None = None  # the open message's: "reasoning", "content" or "call"; None: between messages
    thought: bool = False  # whether the answer had thinking (a whole answer's reasoning is then not None)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, tool-call deltas) of this piece of the answer."""
        reasoning, content, deltas = [], [], []
        self.held += text
        while self.held:
            if self.kind is None:  # between messages: the next header
                opened = self.held.find(MESSAGE)
                if opened < 0:
                    if final or not _could_be_header(self.held):  # not harmony after all: plain text
                        self.kind = "content"
                        continue
                    break
                self._open(self.held[:opened], deltas)
                self.held = self.held[opened + len(MESSAGE):]
                continue
            end = min((i for i in (self.held.find(m) for m in CLOSERS) if i >= 0), default=-1)
            body = self.held if end < 0 else self.held[:end]
            if end < 0 and not final:  # keep what may be the start of a marker
                body = body[: len(body) - _partial_marker(body)]
            self._body(body, reasoning, content, deltas)
            self.held = self.held[len(body):]
            if end < 0:
                break
            closer = next(m for m in CLOSERS if self.held.startswith(m))
            self.kind, self.held = None, self.held[len(closer):] if closer != START else self.held
        if final:
            self.held = ""
        return "".join(reasoning), "".join(content), one_per_call(deltas)

    def _open(self, header: str, deltas: list[dict[str, Any]]) -> None:
        """A message whose header is `header`: a call (to an offered function), thinking (the
        analysis channel) or content (final, or commentary for the user)."""
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        name = None if recipient is None else recipient.group(1)
        if name is not None and name.startswith(FUNCTIONS) and name[len(FUNCTIONS):] in self.tool_names:
            self.kind, name = "call", name[len(FUNCTIONS):]
            call = {"index": len(self.calls), "id": HERMES.call_id(), "type": "function",
                    "function": {"name": name, "arguments": ""}}
            self.calls.append(call)
            deltas.append({**call, "function": dict(call["function"])})
        elif channel is not None and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _body(self, text: str, reasoning: list[str], content: list[str], deltas: list[dict[str, Any]]) -> None:
        if not text:
            return
        if self.kind == "call":
            self.calls[-1]["function"]["arguments"] += text
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": text}})
        elif self.kind == "reasoning":
            self.thought = True
            reasoning.append(text)
        else:
            content.append(text)


def _could_be_header(text: str) -> bool:
    """Whether text (no <|message|> yet) may still be a message's header: it opens with a marker or
    the role, and is not too long."""
    if len(text) > MAX_HEADER:
        return False
    stripped = text.lstrip()
    return any(stripped.startswith(opening) or opening.startswith(stripped)
               for opening in (START, CHANNEL, "assistant", "to="))


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker."""
    for size in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in MARKERS):
            return size
    return 0


def tool_constraint(offered: list[Tool], choice: str | NamedToolChoice | None
                    ) -> tuple[StructuredOutputs | None, str]:
    """(constraint, header the prompt writes) for a tool_choice: with "auto" the model calls in its
    own channels, unconstrained; a named function (or "required" with one function offered) gets
    its call's header in the prompt and its parameters' schema on the body; "required" with
    several, the header up to `functions.` and a grammar: an offered name, the rest of its header
    (harmony's markers as the special tokens they are) and a body its parameters' schema allows."""
    if choice in (None, "auto", "none"):
        return None, ""
    if choice == "required" and len(offered) > 1:
        calls = []
        for tool in offered:
            schema = {**arguments_schema(tool), "x-guidance": JSON_LAYOUT}
            calls.append(f'{json.dumps(tool.function.name + " ")} {CONSTRAIN} "json" {MESSAGE} '
                         f"%json {json.dumps(schema)}")
        grammar = "start: " + "\n     | ".join(calls) + "\n"
        return StructuredOutputs(grammar=grammar), CALL_HEADER
    name = choice.function.name if isinstance(choice, NamedToolChoice) else offered[0].function.name
    tool = next(t for t in offered if t.function.name == name)
    return StructuredOutputs(json=tool.function.parameters or {"type": "object"}), header_for(name)

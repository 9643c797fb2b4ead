"""Reading tool calls out of a chat answer, streamed or whole, in the format the model writes them
(tools.ToolFormat): CallParser holds what a request offered; ToolCallStream splits the text into
content and OpenAI's tool-call deltas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hyperserve.server.protocol import Tool
from hyperserve.server.tools import HERMES, ToolFormat


@dataclass(frozen=True)
class CallParser:
    """How a chat answer's tool calls are read: the functions offered, whether the tool choice
    allowed nothing but calls ("required" or a named function), and the format."""

    tool_names: frozenset[str]
    calls_only: bool = False
    fmt: ToolFormat = HERMES
    # (function, parameter) whose values are strings
    string_parameters: frozenset[tuple[str, str]] = frozenset()

    @classmethod
    def offered(cls, tools: list[Tool], calls_only: bool, fmt: ToolFormat) -> CallParser:
        strings = {(tool.function.name, name) for tool in tools
                   for name, spec in ((tool.function.parameters or {}).get("properties") or {}).items()
                   if isinstance(spec, dict) and spec.get("type") == "string"}
        return cls(frozenset(tool.function.name for tool in tools), calls_only, fmt, frozenset(strings))

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse_tool_calls(text, set(self.tool_names), self.calls_only, self.fmt, self.string_parameters)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(set(self.tool_names), self.calls_only, self.fmt, self.string_parameters)


def parse_tool_calls(text: str, tool_names: set[str], calls_only: bool = False, fmt: ToolFormat = HERMES,
                     string_parameters: frozenset[tuple[str, str]] = frozenset()
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole answer, read as ToolCallStream reads a stream, so both give
    the same calls and content (None when nothing is left, or with `calls_only`)."""
    stream = ToolCallStream(tool_names, calls_only, fmt, string_parameters)
    content, _ = stream.feed(text, final=True)
    calls = whole_calls(stream.calls)
    return None if calls_only else content.strip() or None, calls


# A call's opening as the grammar writes it, up to the first character of its arguments
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,'
                        r'\s*"(?:arguments|parameters)"\s*:\s*(\S)')
# In Qwen3-Coder's XML: a call's opening, a parameter's (its value starts after the newline), and the end
_XML_HEAD = re.compile(r"\s*<function=([^>\n]*)>")
_XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>\n")
_XML_CLOSE = "\n</parameter>"


@dataclass
class ToolCallStream:
    """Splits an answer, streamed or whole, into content and tool-call deltas as OpenAI streams them:
    a call's id, type and name once its name is known and offered, then its arguments (their JSON
    text as the model writes it) piece by piece.

    A call in XML (Qwen3-Coder) streams its arguments as JSON too: "{", then `"name": value` per
    parameter (a string parameter's text as it comes, any other's read as JSON once it closes), "}".

    Where the calls stand (`state`): "text" (content, held back where it may be a marker in the
    making), "head" (a call's opening), "arguments" (JSON), "parameters" (XML), "close" (a JSON
    call's closing brace), "between" (after a call: the block's end, or a list's or bare answer's
    separator), "after" (a list's or a bare answer's calls are over: the rest is content).
    Text that is not a call stays content: a block that does not hold a call to an offered tool,
    and a list or bare answer whose first call does not open as one. `region` keeps such text
    until it is known. A call cut short (max_tokens, a stop string) after its name keeps the
    arguments written; `calls_only` (the grammar allowed only calls): no text is content."""

    tool_names: set[str]
    calls_only: bool = False
    fmt: ToolFormat = HERMES
    string_parameters: frozenset[tuple[str, str]] = frozenset()  # as CallParser's
    pending: str = ""  # text not yet resolved
    region: str = ""  # a block, or a list's or bare answer's opening, until its first call is known
    state: str = "text"
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls so far, with their `index`
    depth: int = 0  # the arguments' JSON: open brackets, and whether inside a string or after a backslash
    in_string: bool = False
    escaped: bool = False
    string_from: int | None = None  # inside an XML string parameter's value (see _string_value)
    text_after_call: bool = False  # content other than whitespace sent since the last call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """New text in; (content to send now, call deltas with their `index`)."""
        self.pending += text
        content, deltas = [], []
        while self._step(final, content, deltas):
            pass
        if final:  # a call that never opened is content, unless it cut a list's or bare answer's calls short
            if self.state == "head" and (self.fmt.layout == "blocks" or not self.calls):
                content.append(self.region + self.pending)
            self.region = self.pending = ""
        return "" if self.calls_only else "".join(content), one_per_call(deltas)

    def _step(self, final: bool, content: list[str], deltas: list[dict[str, Any]]) -> bool:
        """Resolve what the pending text allows in the current state; True if the state moved on."""
        pending = self.pending
        if self.state == "text":
            return self._find_calls(final, content)
        if self.state == "head":
            return self._open_call(final, content, deltas)
        if self.state == "arguments":
            end = self._scan(pending)
            self._add_arguments(pending if end is None else pending[:end], deltas)
            self.pending = "" if end is None else pending[end:]
            return end is not None and self._move("close")
        if self.state == "parameters":
            return self._parameter(deltas)
        if self.state == "close":
            rest = pending.lstrip()
            if not rest:
                return False
            self.pending = rest[1:] if rest.startswith("}") else rest
            return self._move("between")
        if self.state == "between":
            return self._between(final, content)
        return self._send(pending, final, content)  # "after"

    def _send(self, text: str, final: bool, content: list[str]) -> bool:
        """The pending text up to `text`'s length as content; right after a call, whitespace waits
        to be followed by more text (whitespace between calls, or after the last, is not content)."""
        if self.calls and not self.text_after_call and not text.strip():
            self.pending = "" if final else self.pending
            return False
        content.append(text)
        self.pending = self.pending[len(text) :]
        self.text_after_call = self.text_after_call or bool(self.calls and text.strip())
        return False

    def _find_calls(self, final: bool, content: list[str]) -> bool:
        """Content up to where calls begin: a marker (blocks, a list's "["), or the answer's start
        (bare); a marker in the making is held back."""
        fmt, pending = self.fmt, self.pending
        if fmt.layout == "bare":  # calls only as the whole answer: decided at its start
            head = pending.lstrip()
            if not final and (not head or fmt.marker.startswith(head)):
                return False  # nothing yet, or the marker in the making
            if not head.startswith((fmt.marker, "{")):
                return self._move("after")
            start = len(pending) - len(head)
            skip = len(fmt.marker) if head.startswith(fmt.marker) else 0
            content.append(pending[:start])
            self.region, self.pending = pending[start : start + skip], pending[start + skip :]
            return self._move("head")
        start = pending.find(fmt.marker)
        if start < 0:
            keep = 0 if final else _partial_suffix(pending, fmt.marker)
            return self._send(pending[: len(pending) - keep], final, content)
        before = pending[:start]
        if before.strip() or not self.calls or self.text_after_call:  # (as _send)
            content.append(before)
        self.region, self.pending = fmt.marker, pending[start + len(fmt.marker) :]
        if fmt.layout == "list":
            opened = self.pending.lstrip()
            if not opened:
                self.region, self.pending = "", fmt.marker + self.pending  # wait for the "["
                return False
            if not opened.startswith("["):
                content.append(self.region)
                self.region = ""
                return self._move("after")
            self.region += self.pending[: len(self.pending) - len(opened) + 1]
            self.pending = opened[1:]
        return self._move("head")

    def _open_call(self, final: bool, content: list[str], deltas: list[dict[str, Any]]) -> bool:
        """A call's opening: its id and name sent once known and offered, then its arguments. A
        block that closes without such an opening is read whole (a call, or content)."""
        if self.fmt.syntax == "xml":
            match = _XML_HEAD.match(self.pending)
            if match and match.group(1) in self.tool_names:
                self._add_call(match.group(1), deltas)
                self._add_arguments("{", deltas)
                self.region, self.pending = "", self.pending[match.end() :]
                return self._move("parameters")
        else:
            match = _CALL_HEAD.match(self.pending)
            if match and match.group(2) == "{" and _loads(match.group(1)) in self.tool_names:
                self._add_call(_loads(match.group(1)), deltas)
                self.region, self.pending = "", self.pending[match.start(2) :]
                self.depth, self.in_string, self.escaped = 0, False, False
                return self._move("arguments")
        if self.fmt.layout != "blocks":
            return False  # a list's or bare answer's call that does not open as one: content at the end
        end = self.pending.find(self.fmt.close)
        if end < 0:
            return False
        call = _call(_loads(self.pending[:end].strip()), self.tool_names, self.fmt)
        block = self.region + self.pending[: end + len(self.fmt.close)]
        self.region, self.pending = "", self.pending[end + len(self.fmt.close) :]
        if call is None:
            content.append(block)
        else:
            call["index"] = len(self.calls)
            self.calls.append(call)
            self.text_after_call = False
            deltas.append(call)
        return self._move("text")

    def _add_call(self, name: str, deltas: list[dict[str, Any]]) -> None:
        call = {"index": len(self.calls), "id": self.fmt.call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        self.text_after_call = False
        deltas.append({**call, "function": dict(call["function"])})  # the call's arguments grow

    def _add_arguments(self, piece: str, deltas: list[dict[str, Any]]) -> None:
        if piece:
            self.calls[-1]["function"]["arguments"] += piece
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})

    def _parameter(self, deltas: list[dict[str, Any]]) -> bool:
        """An XML call's next parameter, as JSON: a string's name at once and its text as it comes
        (`_string_value`), any other once it closes; or the call's end."""
        if self.string_from is not None:
            return self._string_value(deltas)
        rest = self.pending.lstrip()
        if rest.startswith("</function>"):
            self._add_arguments("}", deltas)
            self.pending = rest[len("</function>") :]
            return self._move("between")
        match = _XML_PARAMETER.match(self.pending)
        if match is None:
            return False
        name, separator = match.group(1), "" if self.calls[-1]["function"]["arguments"] == "{" else ", "
        if (self.calls[-1]["function"]["name"], name) in self.string_parameters:
            self._add_arguments(f'{separator}{json.dumps(name)}: "', deltas)
            # from after the opening's newline
            self.pending, self.string_from = self.pending[match.end() - 1 :], 1
            return True
        end = self.pending.find(_XML_CLOSE, match.end() - 1)
        if end < 0:
            return False
        value = _xml_argument(self.pending[match.end() : max(end, match.end())])
        self._add_arguments(f"{separator}{json.dumps(name)}: {json.dumps(value)}", deltas)
        self.pending = self.pending[end + len(_XML_CLOSE) :]
        return True

    def _string_value(self, deltas: list[dict[str, Any]]) -> bool:
        """A string parameter's text, JSON-escaped as it comes, all but what may be its closing tag
        in the making; the closing quote once the tag is there. `pending` starts at the opening's
        newline (string_from 1: not yet sent) or within the text (0)."""
        end = self.pending.find(_XML_CLOSE)
        stop = end if end >= 0 else len(self.pending) - _partial_suffix(self.pending, _XML_CLOSE)
        piece = self.pending[self.string_from : stop]
        if end >= 0:  # (an empty value: the opening's newline is the closing tag's)
            self._add_arguments(json.dumps(piece)[1:-1] + '"', deltas)
            self.pending, self.string_from = self.pending[end + len(_XML_CLOSE) :], None
            return True
        if stop > self.string_from:
            self._add_arguments(json.dumps(piece)[1:-1], deltas)
            self.pending, self.string_from = self.pending[stop:], 0
        return False

    def _between(self, final: bool, content: list[str]) -> bool:
        """After a call: the block's close (what else is before it is dropped), or a list's or bare
        answer's separator to the next call; anything else ends the calls and is content."""
        rest = self.pending.lstrip()
        if self.fmt.layout == "blocks":
            end = rest.find(self.fmt.close)
            if end < 0:
                return False
            self.pending = rest[end + len(self.fmt.close) :]
            return self._move("text")
        if not rest:
            return False
        separator = "," if self.fmt.layout == "list" else ";"
        if rest.startswith(separator):
            self.pending = rest[1:]
            return self._move("head")
        self.pending = rest[1:] if self.fmt.layout == "list" and rest.startswith("]") else rest
        return self._move("after")

    def _scan(self, text: str) -> int | None:
        """Where the arguments' JSON value ends in `text` (just past it), None if not yet: brackets
        counted outside strings, from the value's first character on."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None

    def _move(self, state: str) -> bool:
        self.state = state
        return True


def whole_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream's calls as a whole answer's message holds them (without their stream index)."""
    return [{key: value for key, value in call.items() if key != "index"} for call in calls]


def one_per_call(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A call's deltas of one feed as one (its opening, if there, with the arguments after it), as
    a stream chunk holds each call once."""
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        if merged and merged[-1]["index"] == delta["index"] and "id" not in delta:
            merged[-1]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            merged.append({**delta, "function": dict(delta["function"])})
    return merged


def _xml_argument(text: str) -> Any:
    """A parameter's value written in XML: JSON where it reads as JSON, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _loads(body: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _call(parsed: Any, tool_names: set[str], fmt: ToolFormat) -> dict[str, Any] | None:
    """A whole call, read as JSON (a block whose call does not open as the grammar writes it)."""
    if not isinstance(parsed, dict) or parsed.get("name") not in tool_names:
        return None
    arguments = parsed.get(fmt.arguments_key, parsed.get("arguments", parsed.get("parameters", {})))
    return {"id": fmt.call_id(), "type": "function",
            "function": {"name": parsed["name"], "arguments": json.dumps(arguments)}}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0

"""Tool calling: tools into the prompt, the call format into the grammar, calls out of the text.

Calls use Hermes' format, which Qwen 2.5/3, Hermes and SmolLM3 are trained on: one block per call,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that renders tools itself in this format gets the tools and the conversation as
they are. Any other template (SmolLM2's, Llama 3's) gets FALLBACK_PROMPT as a system message, with
earlier calls written out as blocks and tool results as user messages in <tool_response> tags.

The grammar enforces the format: with tool_choice "required" the answer is only calls (one, or
several with parallel_tool_calls), with a named function one call to it, their arguments valid
against the function's schema; with "auto" the answer is free text, but once a `<tool_call>`
begins, what follows is a call that parses and validates.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llguidance import StructTag

from hyperserve.engine.structured_output import JSON_LAYOUT, strict_schema
from hyperserve.sampling_params import StructuredOutputs
from hyperserve.server.protocol import NamedToolChoice, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)

FALLBACK_PROMPT = """You can call functions to help answer. To call one, reply with a <tool_call> block \
holding a JSON object with the function's name and arguments, one block per call:
<tool_call>
{{"name": "function_name", "arguments": {{"argument": "value"}}}}
</tool_call>
Call a function only when it helps; otherwise answer normally. The functions:
<tools>
{tools}
</tools>"""


def template_calls_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools and tool calls itself, in the format parsed here."""
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template


def render_messages(messages: list[dict[str, Any]], tools: list[Tool] | None, native: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as they are when the template renders tools
    (`native`), else with the tools described in a system message and calls and results as text."""
    specs = [tool.model_dump(exclude_none=True) for tool in tools or []]
    if native:
        return messages, specs or None
    rendered = [_as_text(message) for message in messages]
    if specs:
        prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(spec["function"]) for spec in specs))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = [_block(call["function"]["name"], call["function"]["arguments"]) for call in message.get("tool_calls", [])]
    content = "\n".join(([message["content"]] if message["content"] else []) + calls)
    return {"role": message["role"], "content": content}


def _block(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def tool_constraint(tools: list[Tool], choice: str | NamedToolChoice | None, parallel: bool,
                    open_is_special: bool) -> StructuredOutputs | None:
    """The grammar a tool_choice asks for (None for "none")."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [tool for tool in tools if tool.function.name == choice.function.name]
    schema = _call_schema(tools)
    if choice is None or choice == "auto":
        tag = StructTag(trigger=OPEN, begin=OPEN + "\n", grammar=schema, end="\n" + CLOSE)
        return StructuredOutputs(grammar=StructTag.to_grammar([tag], assume_special=open_is_special))
    call = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    several = parallel and not isinstance(choice, NamedToolChoice)  # a named function: one call to it
    return StructuredOutputs(grammar=f'start: call ("\\n" call)*\ncall: {call}' if several else f"start: {call}")


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    """A call to one of these tools: {"name": <its name>, "arguments": <valid for its schema>}."""
    options = [{"type": "object",
                "properties": {"name": {"const": tool.function.name},
                               "arguments": strict_schema(tool.function.parameters or {"type": "object",
                                                                                      "properties": {}})},
                "required": ["name", "arguments"], "additionalProperties": False}
               for tool in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


@dataclass(frozen=True)
class CallParser:
    """How a chat answer's tool calls are read: the functions offered, and whether the tool choice
    allowed nothing but calls ("required" or a named function)."""

    tool_names: frozenset[str]
    calls_only: bool = False

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse_tool_calls(text, set(self.tool_names), self.calls_only)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(set(self.tool_names), self.calls_only)


def parse_tool_calls(text: str, tool_names: set[str], calls_only: bool = False
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an answer: the calls are the well-formed blocks naming known tools,
    the content what is left outside them (None when nothing is). `calls_only`: the grammar allowed
    nothing but calls, so what is left is a call cut short by max_tokens, not content."""
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        call = _call(match.group(1), tool_names)
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    if not calls:
        return None if calls_only else text, []
    content = ("".join(kept) + text[last:]).strip()
    return None if calls_only else content or None, calls


def _call(body: str, tool_names: set[str]) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.get("name") not in tool_names:
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed["name"], "arguments": json.dumps(arguments)}}


@dataclass
class ToolCallStream:
    """Splits a streamed answer into content deltas and whole tool calls as they complete.

    Text that may be the start of a `<tool_call>` block is held back until it is known not to
    be; a call is sent as one delta once its block closes (OpenAI clients accumulate deltas, so
    a whole call is a valid stream). `calls_only`: as in parse_tool_calls, no text is content."""

    tool_names: set[str]
    calls_only: bool = False
    pending: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """New text in; (content to send now, calls completed now, with their `index`)."""
        self.pending += text
        content, calls = [], []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.pending, OPEN)
                content.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            end = self.pending.find(CLOSE, start)
            if end < 0:
                content.append(self.pending[:start])
                self.pending = self.pending[start:]
                if final:  # an unfinished block stays text
                    content.append(self.pending)
                    self.pending = ""
                break
            call = _call(self.pending[start + len(OPEN) : end].strip(), self.tool_names)
            before, block = self.pending[:start], self.pending[start : end + len(CLOSE)]
            self.pending = self.pending[end + len(CLOSE) :]
            if call is None:
                content.append(before + block)
                continue
            content.append(before if not self.calls and not calls else before.strip())
            calls.append({"index": len(self.calls) + len(calls), **call})
        self.calls.extend(calls)
        text_out = "".join(content)
        if self.calls_only or (self.calls and not text_out.strip()):
            text_out = ""  # whitespace between calls, or a call cut short, is not content
        return text_out, calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0

"""Tool calling: tools into the prompt, the call format into the grammar, calls out of the text.

Each model family writes its calls its own way (ToolFormat, FORMATS):

    hermes       <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
                 one block per call, anywhere in the answer (Qwen 2.5/3, Hermes, SmolLM3)
    mistral      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
                 a list that ends the answer (Mistral 7B v0.3, Nemo, Small 3)
    granite      <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...] (Granite 3)
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}, several joined by "; ", as
                 the whole answer, after <|python_tag|> or not (Llama 3.1-3.3)

The chat template says which (`detect_format`); --tool-call-parser names one where it cannot. A
template that renders tools itself in the format used gets the tools and the conversation as they
are. Any other (SmolLM2's) gets FALLBACK_PROMPT as a system message, with earlier calls written out
in the format and tool results as user messages in <tool_response> tags.

The grammar enforces the format: with tool_choice "required" the answer is only calls (one, or
several with parallel_tool_calls), with a named function one call to it, their arguments valid
against the function's schema; with "auto" the answer is free text, but once the format's marker
begins, what follows is calls that parse and validate.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from llguidance import StructTag

from hyperserve.engine.structured_output import JSON_LAYOUT, strict_schema
from hyperserve.sampling_params import StructuredOutputs
from hyperserve.server.protocol import NamedToolChoice, Tool

FALLBACK_PROMPT = """You can call functions to help answer. To call one, reply with {how}, for example:
{example}
Call a function only when it helps; otherwise answer normally. The functions:
<tools>
{tools}
</tools>"""


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls (see the module's docstring)."""

    name: str
    layout: str  # "blocks": a block per call, anywhere; "list": a JSON list after the marker, ending the
    #              answer; "bare": JSON objects joined by "; " as the whole answer, the marker optional
    marker: str  # what opens a block, or the calls
    close: str = ""  # what closes a block
    arguments_key: str = "arguments"
    signs: tuple[str, ...] = ()  # text in a chat template that renders tools in this format
    id_length: int | None = None  # call ids of this many letters and digits (Mistral's templates check)
    how: str = ""  # the fallback prompt's description of the format

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """Calls as the model writes them."""
        objects = [json.dumps({"name": name, self.arguments_key: arguments}) for name, arguments in calls]
        if self.layout == "blocks":
            return "\n".join(f"{self.marker}\n{o}\n{self.close}" for o in objects)
        if self.layout == "list":
            return f"{self.marker}[{', '.join(objects)}]"
        return "; ".join(objects)

    def call_id(self) -> str:
        if self.id_length is None:
            return f"call_{uuid.uuid4().hex[:24]}"
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(self.id_length))


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", "blocks", "<tool_call>", "</tool_call>", signs=("<tool_call>",),
               how="a <tool_call> block holding a JSON object with the function's name and arguments, one "
                   "block per call"),
    ToolFormat("mistral", "list", "[TOOL_CALLS]", signs=("[TOOL_CALLS]",), id_length=9,
               how="[TOOL_CALLS] and a JSON list of objects with each function's name and arguments"),
    ToolFormat("granite", "list", "<|tool_call|>", signs=("<|tool_call|>",),
               how="<|tool_call|> and a JSON list of objects with each function's name and arguments"),
    ToolFormat("llama3_json", "bare", "<|python_tag|>", arguments_key="parameters",
               signs=("<|python_tag|>", '"parameters": dictionary'),
               how='nothing but a JSON object {"name": function name, "parameters": its arguments}, several '
                   'joined by "; "'),
)}
HERMES = FORMATS["hermes"]


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The format a chat template renders tools and calls in itself; None if it renders none."""
    if not isinstance(chat_template, str) or "tools" not in chat_template:
        return None
    return next((f for f in FORMATS.values() if any(sign in chat_template for sign in f.signs)), None)


def render_messages(messages: list[dict[str, Any]], tools: list[Tool] | None, native: bool,
                    fmt: ToolFormat = HERMES) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as they are when the template renders tools
    (`native`), else with the tools described in a system message and calls and results as text."""
    specs = [tool.model_dump(exclude_none=True) for tool in tools or []]
    if native:
        return messages, specs or None
    rendered = [_as_text(message, fmt) for message in messages]
    if specs:
        prompt = FALLBACK_PROMPT.format(how=fmt.how, example=fmt.write([("function_name", {"argument": "value"})]),
                                        tools="\n".join(json.dumps(spec["function"]) for spec in specs))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _as_text(message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = [(call["function"]["name"], call["function"]["arguments"]) for call in message.get("tool_calls", [])]
    content = "\n".join(([message["content"]] if message["content"] else []) + ([fmt.write(calls)] if calls else []))
    return {"role": message["role"], "content": content}


def tool_constraint(tools: list[Tool], choice: str | NamedToolChoice | None, parallel: bool,
                    fmt: ToolFormat = HERMES, marker_id: int | None = None) -> StructuredOutputs | None:
    """The grammar a tool_choice asks for (None for "none"). `marker_id`: the format's marker is
    this one token of the vocabulary, which the grammar then asks for (a model writes its own
    marker as that token, and a special token is not text)."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [tool for tool in tools if tool.function.name == choice.function.name]
    schema = _call_schema(tools, fmt.arguments_key)
    several = parallel and not isinstance(choice, NamedToolChoice)  # a named function: one call to it
    if choice is None or choice == "auto":
        return StructuredOutputs(grammar=_text_or_calls(fmt, tools, schema, marker_id))
    call = f"call: %json {json.dumps(schema)}\n"
    if fmt.layout == "blocks":
        block = f'"{fmt.marker}\\n" call "\\n{fmt.close}"'
        return StructuredOutputs(grammar=f'start: {block} ("\\n" {block})*\n{call}' if several
                                 else f"start: {block}\n{call}")
    if fmt.layout == "list":
        marker = f"<[{marker_id}]>" if marker_id is not None else json.dumps(fmt.marker)
        more = '(", " call)* ' if several else ""
        return StructuredOutputs(grammar=f'start: {marker} "[" call {more}"]"\n{call}')
    return StructuredOutputs(grammar=f'start: call ("; " call)*\n{call}' if several else f"start: call\n{call}")


def _text_or_calls(fmt: ToolFormat, tools: list[Tool], schema: dict[str, Any], marker_id: int | None) -> str:
    """tool_choice "auto": any text, in which the format's calls, once begun, are whole and valid
    (Lark as llguidance's StructTag writes it: text up to a trigger, lazily matched, then the calls)."""
    if fmt.layout == "blocks":
        tag = StructTag(trigger=fmt.marker, begin=fmt.marker + "\n", grammar=schema, end="\n" + fmt.close)
        return StructTag.to_grammar([tag], assume_special=marker_id is not None)
    if fmt.layout == "bare":  # a call begins with its first key; the rest is one offered call's
        trigger, rests = '{"name": ', []
        for tool in tools:
            head = f"{json.dumps(tool.function.name)}, {json.dumps(fmt.arguments_key)}: "
            arguments = {**_arguments_schema(tool), "x-guidance": JSON_LAYOUT}
            rests.append(f'{json.dumps(head)} %json {json.dumps(arguments)} "}}"')
        calls = "(" + " | ".join(rests) + ")"
    else:
        trigger, calls = fmt.marker, f'"[" call (", " call)* "]"\ncall: %json {json.dumps(schema)}'
    if marker_id is not None:  # a token, which text cannot hold: the text ends where it comes
        tag = f"tag: TAG_TEXT <[{marker_id}]> {calls}"
    else:
        tag = f"tag_trigger[lazy]: TAG_TEXT {json.dumps(trigger)}\ntag: tag_trigger {calls}"
    return f"%llguidance {{}}\nstart: tag* TAG_TEXT\nTAG_TEXT: /(.|\\n)*/\n{tag}\n"


def _call_schema(tools: list[Tool], arguments_key: str = "arguments") -> dict[str, Any]:
    """A call to one of these tools: {"name": <its name>, <arguments_key>: <valid for its schema>}."""
    options = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                                 arguments_key: _arguments_schema(tool)},
                "required": ["name", arguments_key], "additionalProperties": False}
               for tool in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    return strict_schema(tool.function.parameters or {"type": "object", "properties": {}})


@dataclass(frozen=True)
class CallParser:
    """How a chat answer's tool calls are read: the functions offered, whether the tool choice
    allowed nothing but calls ("required" or a named function), and the format."""

    tool_names: frozenset[str]
    calls_only: bool = False
    fmt: ToolFormat = HERMES

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse_tool_calls(text, set(self.tool_names), self.calls_only, self.fmt)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(set(self.tool_names), self.calls_only, self.fmt)


def parse_tool_calls(text: str, tool_names: set[str], calls_only: bool = False, fmt: ToolFormat = HERMES
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an answer: the calls are the well-formed ones naming known tools,
    the content what is left outside them (None when nothing is). `calls_only`: the grammar allowed
    nothing but calls, so what is left is a call cut short by max_tokens, not content. In the list
    and bare formats the calls are all or nothing unless `calls_only`: text that does not parse
    whole is the model's answer."""
    if fmt.layout != "blocks":
        start = _calls_start(text, fmt)
        calls, end = _json_calls(text[start:], tool_names, fmt) if start >= 0 else ([], None)
        if calls_only or not calls or end is None:
            return None if calls_only else text, calls if calls_only else []
        return (text[:start] + text[start + end:]).strip() or None, calls
    calls, kept, last = [], [], 0
    for match in _block_pattern(fmt).finditer(text):
        call = _call(_loads(match.group(1)), tool_names, fmt)
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    if not calls:
        return None if calls_only else text, []
    content = ("".join(kept) + text[last:]).strip()
    return None if calls_only else content or None, calls


def _block_pattern(fmt: ToolFormat) -> re.Pattern:
    return re.compile(re.escape(fmt.marker) + r"\s*(.*?)\s*" + re.escape(fmt.close), re.DOTALL)


def _calls_start(text: str, fmt: ToolFormat) -> int:
    """Where the calls of a list or bare answer begin: at the marker, or (bare) at a leading JSON object."""
    if fmt.layout == "list":
        return text.find(fmt.marker)
    start = len(text) - len(text.lstrip())
    return start if text.startswith((fmt.marker, "{"), start) else -1


def _json_calls(tail: str, tool_names: set[str], fmt: ToolFormat) -> tuple[list[dict[str, Any]], int | None]:
    """The calls at the start of `tail` (a list after the marker, or objects joined by ";"), and
    where they end; None where they do not end well (cut short, or a call that does not parse)."""
    decoder, calls = json.JSONDecoder(), []
    i = len(fmt.marker) if tail.startswith(fmt.marker) else 0
    i = _skip_space(tail, i)
    if fmt.layout == "list":
        if not tail.startswith("[", i):
            return [], None
        i += 1
    while True:
        i = _skip_space(tail, i)
        if fmt.layout == "list" and tail.startswith("]", i) and not calls:
            return calls, i + 1
        try:
            parsed, i = decoder.raw_decode(tail, i)
        except ValueError:
            return calls, None
        call = _call(parsed, tool_names, fmt)
        if call is None:
            return calls, None
        calls.append(call)
        i = _skip_space(tail, i)
        if fmt.layout == "list" and tail.startswith("]", i):
            return calls, i + 1
        if fmt.layout == "bare" and i == len(tail):
            return calls, i
        if not tail.startswith("," if fmt.layout == "list" else ";", i):
            return calls, None
        i += 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _loads(body: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _call(parsed: Any, tool_names: set[str], fmt: ToolFormat) -> dict[str, Any] | None:
    if not isinstance(parsed, dict) or parsed.get("name") not in tool_names:
        return None
    arguments = parsed.get(fmt.arguments_key, parsed.get("arguments", parsed.get("parameters", {})))
    return {"id": fmt.call_id(), "type": "function",
            "function": {"name": parsed["name"], "arguments": json.dumps(arguments)}}


@dataclass
class ToolCallStream:
    """Splits a streamed answer into content deltas and whole tool calls as they complete.

    Text that may be the start of a marker is held back until it is known not to be. A block's
    call is sent as one delta once the block closes; a list's or a bare answer's calls, which end
    the answer, once it has ended (OpenAI clients accumulate deltas, so whole calls are a valid
    stream). `calls_only`: as in parse_tool_calls, no text is content."""

    tool_names: set[str]
    calls_only: bool = False
    fmt: ToolFormat = HERMES
    pending: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    in_calls: bool | None = None  # list and bare formats: whether the calls have begun (None: bare, unknown yet)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """New text in; (content to send now, calls completed now, with their `index`)."""
        self.pending += text
        content, calls = self._blocks(final) if self.fmt.layout == "blocks" else self._tail(final)
        for call in calls:
            call["index"] = len(self.calls)
            self.calls.append(call)
        if self.calls_only or (self.calls and not content.strip()):
            content = ""  # whitespace between calls, or a call cut short, is not content
        return content, calls

    def _blocks(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        marker, close = self.fmt.marker, self.fmt.close
        content, calls = [], []
        while True:
            start = self.pending.find(marker)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.pending, marker)
                content.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            end = self.pending.find(close, start)
            if end < 0:
                content.append(self.pending[:start])
                self.pending = self.pending[start:]
                if final:  # an unfinished block stays text
                    content.append(self.pending)
                    self.pending = ""
                break
            call = _call(_loads(self.pending[start + len(marker) : end].strip()), self.tool_names, self.fmt)
            before, block = self.pending[:start], self.pending[start : end + len(close)]
            self.pending = self.pending[end + len(close) :]
            if call is None:
                content.append(before + block)
                continue
            content.append(before if not self.calls and not calls else before.strip())
            calls.append(call)
        return "".join(content), calls

    def _tail(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        if not self.in_calls:
            if self.fmt.layout == "list":
                start = self.pending.find(self.fmt.marker)
                if start < 0:  # no calls yet: all but a marker in the making is content
                    keep = len(self.pending) - (0 if final else _partial_suffix(self.pending, self.fmt.marker))
                    content, self.pending = self.pending[:keep], self.pending[keep:]
                    return content, []
                self.in_calls = True
                content, self.pending = self.pending[:start], self.pending[start:]
            elif self.in_calls is None:  # bare: the calls are the whole answer, or there are none
                head = self.pending.lstrip()
                if not final and (not head or self.fmt.marker.startswith(head)):
                    return "", []  # nothing yet, or the marker in the making
                self.in_calls = _calls_start(self.pending, self.fmt) >= 0
            if not self.in_calls:
                content, self.pending = content + self.pending, ""
                return content, []
        if not final:
            return content, []
        text, calls = parse_tool_calls(self.pending, self.tool_names, self.calls_only, self.fmt)
        self.pending = ""
        return content + (text or ""), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0

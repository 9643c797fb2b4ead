"""Tool calling: tools into the prompt, the call format into the grammar, calls out of the text.

Each model family writes its calls its own way (ToolFormat, FORMATS):

    qwen3_coder  <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n
                 </tool_call>: the same blocks, in XML, a parameter's value on its own lines (Qwen3-Coder)
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

Calls are read as OpenAI streams them (ToolCallStream): each call's id and name as soon as the name
is written, then its arguments' JSON text in pieces; a whole answer is read the same way.
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
    syntax: str = "json"  # a call as a JSON object, or (blocks only) "xml": <function=...> and its parameters

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """Calls as the model writes them."""
        if self.syntax == "xml":
            return "\n".join(f"{self.marker}\n{_xml_call(name, arguments)}\n{self.close}" for name, arguments in calls)
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


def _xml_call(name: str, arguments: Any) -> str:
    """A call in Qwen3-Coder's XML, as its chat template writes one: each parameter's value on its
    own lines, strings as they are and anything else as JSON."""
    parameters = "".join(f"<parameter={key}>\n{_xml_value(value)}\n</parameter>\n"
                         for key, value in (arguments.items() if isinstance(arguments, dict) else ()))
    return f"<function={name}>\n{parameters}</function>"


def _xml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# (first in the detection order: Qwen3-Coder's templates hold "<tool_call>" too)
FORMATS = {f.name: f for f in (
    ToolFormat("qwen3_coder", "blocks", "<tool_call>", "</tool_call>", signs=("<function=",), syntax="xml",
               how="a <tool_call> block holding <function=the function's name>, then each argument as "
                   "<parameter=its name>, its value on the next lines, </parameter>; then </function>; one "
                   "block per call"),
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
    if fmt.syntax == "xml":
        call = _xml_call_rules(tools)
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
    if fmt.layout == "blocks" and fmt.syntax == "json":
        tag = StructTag(trigger=fmt.marker, begin=fmt.marker + "\n", grammar=schema, end="\n" + fmt.close)
        return StructTag.to_grammar([tag], assume_special=marker_id is not None)
    if fmt.layout == "blocks":  # XML calls: a Lark grammar, which StructTag would make a separate grammar
        trigger, calls = fmt.marker, f'"\\n" call {json.dumps(chr(10) + fmt.close)}\n{_xml_call_rules(tools)}'
    elif fmt.layout == "bare":  # a call begins with its first key; the rest is one offered call's
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


def _xml_call_rules(tools: list[Tool]) -> str:
    """Lark rules for one call (`call`) in Qwen3-Coder's XML: <function=name>, then the function's
    parameters in its schema's order, the required ones always and the others if the model
    chooses. A string's value is any text (within its minLength and maxLength) up to its closing
    tag; a value of any other type is JSON valid for its schema; an enumerated one is one of its
    values as _xml_value writes it."""
    rules, calls, strings = [], [], {}
    for i, tool in enumerate(tools):
        schema = _arguments_schema(tool)
        required, parameters = set(schema.get("required", ())), []
        for j, (name, spec) in enumerate((schema.get("properties") or {}).items()):
            opening = json.dumps(f"<parameter={name}>\n")
            rules.append(f'xml_{i}_{j}: {opening} {_xml_rule(spec, schema, strings)} "\\n"')
            parameters.append(f"xml_{i}_{j}" + ("" if name in required else "?"))
        calls.append(f"xml_{i}")
        opening = json.dumps(f"<function={tool.function.name}>\n")
        rules.append(f'xml_{i}: {opening} {" ".join(parameters)} "</function>"')
    return "\n".join([f"call: {' | '.join(calls)}", *rules, *strings.values(), ""])


def unreadable_xml_parameter(tools: list[Tool]) -> str | None:
    """The first "function.parameter" whose name Qwen3-Coder's XML cannot carry: a `>` or a line
    break would end its <parameter=...> tag early, so the grammar could write the call but no
    reader could take it back."""
    for tool in tools:
        for name in ((tool.function.parameters or {}).get("properties") or {}):
            if ">" in name or "\n" in name or "\r" in name:
                return f"{tool.function.name}.{name}"
    return None


_XML_END = r'"\n</parameter>"'


def _xml_rule(spec: dict[str, Any], schema: dict[str, Any], strings: dict[str, str]) -> str:
    """A parameter's value and its closing tag; a string's rule is added to `strings` by name."""
    values = spec["enum"] if "enum" in spec else [spec["const"]] if "const" in spec else None
    if values is not None:
        return "(" + " | ".join(json.dumps(_xml_value(v)) for v in values) + f") {_XML_END}"
    if spec.get("type") == "string":  # text up to the first closing tag: a lazy lexeme that ends with the tag
        low, high = int(spec.get("minLength", 0)), spec.get("maxLength")
        name = f"xml_string_{low}_{high if high is not None else 'n'}"
        bounds = f"{{{low},{int(high) if high is not None else ''}}}"
        strings[name] = f"{name}[lazy]: /(.|\\n){bounds}/ {_XML_END}"
        return name
    defs = {"$defs": schema["$defs"]} if "$defs" in schema else {}  # what its $refs point at
    return f"%json {json.dumps({**spec, **defs, 'x-guidance': JSON_LAYOUT})} {_XML_END}"


@dataclass(frozen=True)
class CallParser:
    """How a chat answer's tool calls are read: the functions offered, whether the tool choice
    allowed nothing but calls ("required" or a named function), and the format."""

    tool_names: frozenset[str]
    calls_only: bool = False
    fmt: ToolFormat = HERMES
    string_parameters: frozenset[tuple[str, str]] = frozenset()  # (function, parameter) whose values are strings

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
    calls = [{key: value for key, value in call.items() if key != "index"} for call in stream.calls]
    return None if calls_only else content.strip() or None, calls


# A call's opening as the grammar writes it, up to the first character of its arguments
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(\S)')
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
        return "" if self.calls_only else "".join(content), _one_per_call(deltas)

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
            self.pending, self.string_from = self.pending[match.end() - 1 :], 1  # from after the opening's newline
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


def _one_per_call(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
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

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

Calls are read as OpenAI streams them (tool_calls.ToolCallStream): each call's id and name as soon as
the name is written, then its arguments' JSON text in pieces; a whole answer is read the same way.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
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
            return "\n".join(f"{self.marker}\n{_xml_call(name, arguments)}\n{self.close}"
                             for name, arguments in calls)
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
        example = fmt.write([("function_name", {"argument": "value"})])
        prompt = FALLBACK_PROMPT.format(how=fmt.how, example=example,
                                        tools="\n".join(json.dumps(spec["function"]) for spec in specs))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _as_text(message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = [(call["function"]["name"], call["function"]["arguments"])
             for call in message.get("tool_calls", [])]
    parts = ([message["content"]] if message["content"] else []) + ([fmt.write(calls)] if calls else [])
    content = "\n".join(parts)
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
    start = 'start: call ("; " call)*' if several else "start: call"
    return StructuredOutputs(grammar=f"{start}\n{call}")


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
            arguments = {**arguments_schema(tool), "x-guidance": JSON_LAYOUT}
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
                                                 arguments_key: arguments_schema(tool)},
                "required": ["name", arguments_key], "additionalProperties": False}
               for tool in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema a call's arguments are held to (strict_schema's; a function without parameters
    takes an empty object)."""
    return strict_schema(tool.function.parameters or {"type": "object", "properties": {}})


def _xml_call_rules(tools: list[Tool]) -> str:
    """Lark rules for one call (`call`) in Qwen3-Coder's XML: <function=name>, then the function's
    parameters in its schema's order, the required ones always and the others if the model
    chooses. A string's value is any text (within its minLength and maxLength) up to its closing
    tag; a value of any other type is JSON valid for its schema; an enumerated one is one of its
    values as _xml_value writes it."""
    rules, calls, strings = [], [], {}
    for i, tool in enumerate(tools):
        schema = arguments_schema(tool)
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

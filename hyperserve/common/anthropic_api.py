"""Anthropic's Messages API (`POST /v1/messages`, and `/v1/messages/count_tokens` on the server) as
ASGI middleware over chat completions, for code written against Anthropic's SDK.

A Messages request becomes the chat request with the same meaning (common/chat_translation.py):
`system` a system message, text blocks text parts, `tool_use` blocks an assistant's tool calls,
`tool_result` blocks tool messages; the answer comes back as `text` and `tool_use` content blocks
with Anthropic's stop reasons, usage, stream events and error shapes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hyperserve.common.asgi import send_json
from hyperserve.common.chat_translation import call_app, read_json
from hyperserve.common.errors import APIError, validation_body

PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
# chat's finish_reason -> Anthropic's stop_reason ("stop" is end_turn or stop_sequence: see MessageBuilder)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=16384)
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, bash...) have other types


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, max_length=64)
    disable_parallel_tool_use: bool = False


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # refused when enabled

    def chat_body(self) -> dict[str, Any]:
        """The chat completions request with this request's meaning (ValueError names what cannot be served)."""
        if self.thinking and self.thinking.get("type") == "enabled":
            raise ValueError("thinking budgets are not served: a reasoning model here thinks as its chat template "
                             "says, and its thinking comes back as thinking blocks when the server runs with "
                             "--reasoning-parser")
        system = _text_of(self.system, "system") if self.system is not None else None
        messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(self.messages)
        body: dict[str, Any] = {"messages": messages, "max_tokens": self.max_tokens, "stream": self.stream}
        if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
            body.update(add_generation_prompt=False, continue_final_message=True)  # a prefilled answer goes on
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name, value in (("model", self.model), ("temperature", self.temperature), ("top_p", self.top_p),
                            ("top_k", self.top_k), ("stop", self.stop_sequences)):
            if value is not None:
                body[name] = value
        if self.metadata and isinstance(self.metadata.get("user_id"), str):
            body["user"] = self.metadata["user_id"][:1024]
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": tool.name, "parameters": tool.input_schema,
                **({"description": tool.description} if tool.description else {})}} for tool in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            if choice.type == "tool" and not choice.name:
                raise ValueError("tool_choice of type 'tool' needs the tool's name")
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return body


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat's: a user message's tool_result blocks become tool messages (before its other
    content, as Anthropic puts them first); an assistant message's tool_use blocks its tool calls."""
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise ValueError(f"messages[{i}].role must be 'user' or 'assistant' (the system prompt is `system`)")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of content blocks")
        parts, calls = [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                    "name": str(block.get("name", "")), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                text = _text_of(block.get("content", ""), f"messages[{i}] tool_result content")
                chat.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                             "content": f"Error: {text}" if block.get("is_error") else text})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning: these models have none to continue
            else:
                raise ValueError(f"messages[{i}]: content blocks of type {kind!r} are not served (text, tool_use "
                                 "and tool_result are)")
        if parts or calls:
            chat.append({"role": role, "content": parts or None, **({"tool_calls": calls} if calls else {})})
    return chat


def _text_of(content: str | list[Any], where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "\n".join(str(b.get("text", "")) for b in content)
    raise ValueError(f"{where} must be a string or a list of text blocks")


def anthropic_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style error body as Anthropic writes errors."""
    error = body.get("error") or {}
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(error.get("message", ""))}}


@dataclass
class MessageBuilder:
    """One Message built from a chat answer: whole, or chunk by chunk with its stream events."""

    stop_sequences: list[str]
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    model: str | None = None
    content: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: {"input_tokens": 0, "output_tokens": 0})
    stop_reason: str | None = None
    stop_sequence: str | None = None
    failed: bool = False
    _text_index: int | None = None  # the open text block
    _thinking_index: int | None = None  # a reasoning model's thinking (--reasoning-parser): the first block
    _calls: dict[int, int] = field(default_factory=dict)  # chat tool call index -> its block's index
    _arguments: dict[int, str] = field(default_factory=dict)  # block index -> its JSON so far
    _open: list[int] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage}

    def from_completion(self, completion: dict[str, Any]) -> dict[str, Any]:
        self.model = completion.get("model")
        choice = (completion.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        if message.get("reasoning_content") is not None:
            self.content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content") or not message.get("tool_calls"):
            self.content.append({"type": "text", "text": message.get("content") or ""})
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            self.content.append({"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                                 "name": function.get("name", ""), "input": _input(function.get("arguments"))})
        self._usage(completion.get("usage"))
        self._stop(choice)
        return self.message()

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message()}]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:  # the request failed mid-stream (status 200 already sent)
            self.failed = True
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            status = {"service_unavailable": 503, "rate_limit_error": 429}.get(error.get("type"), 500)
            return [anthropic_error(status, {"error": error})]
        self.model = chunk.get("model", self.model)
        self._usage(chunk.get("usage"))
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self._thinking_index is None:
                    self._thinking_index = self._block({"type": "thinking", "thinking": "", "signature": ""}, events)
                self.content[self._thinking_index]["thinking"] += delta["reasoning_content"]
                events.append({"type": "content_block_delta", "index": self._thinking_index,
                               "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
            if delta.get("content"):
                self._close_thinking(events)
                if self._text_index is None:
                    self._text_index = self._block({"type": "text", "text": ""}, events)
                self.content[self._text_index]["text"] += delta["content"]
                events.append({"type": "content_block_delta", "index": self._text_index,
                               "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                chat_index = call.get("index", len(self._calls))
                if chat_index not in self._calls:
                    self._close_thinking(events)
                    self._close_text(events)
                    self._calls[chat_index] = self._block({
                        "type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                        "name": function.get("name", ""), "input": {}}, events)
                index = self._calls[chat_index]
                if function.get("arguments"):
                    self._arguments[index] = self._arguments.get(index, "") + function["arguments"]
                    events.append({"type": "content_block_delta", "index": index,
                                   "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}})
            if choice.get("finish_reason"):
                self._stop(choice)
        return events

    def finish(self) -> list[dict[str, Any]]:
        if self.failed:
            return []
        events: list[dict[str, Any]] = []
        if self._text_index is None and not self._calls:
            self._block({"type": "text", "text": ""}, events)  # an empty answer is still a text block, as whole
        for index in list(self._open):
            self._close(index, events)
        return events + [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                             "stop_sequence": self.stop_sequence},
                          "usage": self.usage},
                         {"type": "message_stop"}]

    def translate_error(self, body: dict[str, Any], status: int) -> dict[str, Any]:
        return anthropic_error(status, body)

    def _block(self, block: dict[str, Any], events: list[dict[str, Any]]) -> int:
        self.content.append(block)
        index = len(self.content) - 1
        self._open.append(index)
        events.append({"type": "content_block_start", "index": index, "content_block": dict(block)})
        return index

    def _close_thinking(self, events: list[dict[str, Any]]) -> None:
        if self._thinking_index in self._open:
            self._close(self._thinking_index, events)

    def _close_text(self, events: list[dict[str, Any]]) -> None:
        if self._text_index is not None and self._text_index in self._open:
            self._close(self._text_index, events)
        self._text_index = None

    def _close(self, index: int, events: list[dict[str, Any]]) -> None:
        self._open.remove(index)
        if index in self._arguments:
            self.content[index]["input"] = _input(self._arguments[index])
        events.append({"type": "content_block_stop", "index": index})

    def _usage(self, usage: dict[str, Any] | None) -> None:
        if usage:
            self.usage = {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0),
                          "cache_read_input_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                          "cache_creation_input_tokens": 0}

    def _stop(self, choice: dict[str, Any]) -> None:
        reason = choice.get("finish_reason")
        matched = choice.get("stop_reason")
        if reason == "stop" and isinstance(matched, str) and matched in self.stop_sequences:
            self.stop_reason, self.stop_sequence = "stop_sequence", matched
        else:
            self.stop_reason = STOP_REASONS.get(reason, "end_turn")


def _input(arguments: Any) -> Any:
    """A tool call's arguments (JSON text) as the object Anthropic's `input` is."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class TokenCount:
    """/v1/messages/count_tokens, answered by the server's /tokenize (never streamed)."""

    def from_completion(self, counted: dict[str, Any]) -> dict[str, Any]:
        return {"input_tokens": counted.get("count", 0)}

    def translate_error(self, body: dict[str, Any], status: int) -> dict[str, Any]:
        return anthropic_error(status, body)

    def start(self) -> list[dict[str, Any]]:
        return []

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def finish(self) -> list[dict[str, Any]]:
        return []


class AnthropicAPI:
    """POST /v1/messages (and /v1/messages/count_tokens where the app serves /tokenize) in front of an
    app that serves /v1/chat/completions. Keys may come as `x-api-key`, as Anthropic's clients send them."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in (PATH, COUNT_PATH):
            return await self.app(scope, receive, send)
        try:
            if scope["method"] != "POST":
                raise APIError(405, f"{path} takes POST")
            body = await read_json(receive)
            try:
                request = MessagesRequest.model_validate({"max_tokens": 1, **body} if path == COUNT_PATH else body)
                chat = request.chat_body()
            except ValidationError as invalid:
                raise APIError(400, validation_body(invalid.errors())["error"]["message"]) from None
            except ValueError as error:
                raise APIError(400, str(error)) from None
            if path == COUNT_PATH:
                tokenize = {name: chat[name] for name in ("messages", "tools", "model") if name in chat}
                return await call_app(self.app, scope, receive, send, tokenize, TokenCount(), path="/tokenize")
            await call_app(self.app, scope, receive, send, chat, MessageBuilder(request.stop_sequences or []))
        except APIError as error:
            await send_json(send, error.status, anthropic_error(error.status, error.body()), error.headers)

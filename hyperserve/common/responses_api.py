"""OpenAI's Responses API (`/v1/responses`) as ASGI middleware over chat completions.

A Responses request is translated into a chat completions request that re-enters the app below, so
API keys, rate limits, guardrails, metrics and (in the gateway) the response cache and routing apply
to it exactly as to chat; its answer, whole or streamed, is translated back: a `message` item for
the text, a `function_call` item per tool call, and the Responses stream's events. Answers are kept
(`store`, true by default, as OpenAI's) in a bounded in-memory store private to each API key, so
`previous_response_id` continues a conversation and GET / DELETE /v1/responses/{id} work.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hyperserve.common.asgi import send_json
from hyperserve.common.chat_translation import call_app, read_json
from hyperserve.common.errors import APIError, validation_body
from hyperserve.common.response_store import DEFAULT_STORE_BYTES, ResponseStore, StoredResponse

PATH = "/v1/responses"
# Chat parameters (vLLM's extras included) that a Responses request may carry and that mean the same there.
PASSTHROUGH = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "logit_bias", "priority", "ignore_eos", "stop_token_ids", "chat_template_kwargs", "cache_salt")
# A chat error's `param`, as the Responses request names it.
LOGPROBS = "message.output_text.logprobs"  # the one `include` served: each output token's logprobs
PARAM_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "messages": "input", "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=16384)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str = Field(max_length=64)


class ResponsesRequest(BaseModel):
    """The fields of a Responses request that are served; those that would change the answer in
    ways this server cannot honour are refused by name rather than ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=1024)
    # refused unless unset (see _refuse)
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = None

    def refused(self) -> str | None:
        """Why the request asks for something not served (None: it does not)."""
        if self.background:
            return "background responses are not served: send the request and wait, or stream it"
        if any(value is not None for key, value in (self.reasoning or {}).items() if key != "effort"):
            return ("reasoning settings but effort are not served: a reasoning model here thinks as its "
                    "chat template says (chat_template_kwargs; reasoning.effort is its reasoning_effort "
                    "variable), and its thinking comes back as a reasoning item")
        if unserved := [name for name in self.include or [] if name != LOGPROBS]:
            return f"include is not served but for {LOGPROBS} (asked for {', '.join(unserved)})"
        if self.truncation == "auto":
            return "truncation 'auto' is not served: an input longer than the context is a 400"
        for name in ("conversation", "prompt", "max_tool_calls"):
            if getattr(self, name) is not None:
                return f"{name} is not served"
        return None

    def echo(self) -> dict[str, Any]:
        """The request's settings as the Response object repeats them."""
        text = self.text or TextConfig()
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tools": [tool.model_dump() for tool in self.tools or []],
            "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction)
            else self.tool_choice or "auto",
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": {"format": text.format.model_dump(by_alias=True, exclude_none=True)},
            "previous_response_id": self.previous_response_id, "store": self.store, "metadata": self.metadata or {},
            "user": self.user, "truncation": "disabled",
            "reasoning": {"effort": self.effort, "summary": None},
            "background": False, "top_logprobs": self.top_logprobs,
        }

    @property
    def effort(self) -> Any:
        """reasoning.effort, chat's reasoning_effort (a variable of the model's chat template)."""
        return (self.reasoning or {}).get("effort")

    def chat_body(self, raw: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completions request that answers this one, given the conversation's messages."""
        body: dict[str, Any] = {"messages": messages, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.effort is not None:
            body["reasoning_effort"] = self.effort
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if LOGPROBS in (self.include or []) or self.top_logprobs is not None:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        for name, value in (("model", self.model), ("max_tokens", self.max_output_tokens),
                            ("temperature", self.temperature), ("top_p", self.top_p), ("user", self.user)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        text_format = (self.text or TextConfig()).format
        if text_format.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif text_format.type == "json_schema":
            schema = {"name": text_format.name or "response", "schema": text_format.schema_,
                      "description": text_format.description, "strict": text_format.strict}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in schema.items() if v is not None}}
        body.update({name: raw[name] for name in PASSTHROUGH if name in raw})
        return body


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages as they are (their text parts as chat's), a run of
    function_call items as one assistant message's tool_calls (joined to the assistant message just
    before, which is how an answer with text and calls reads back), function_call_output items as
    tool messages. Reasoning items carry nothing for these models and are skipped. ValueError names
    the first item that cannot be served."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = [_chat_part(part) for part in content]
            messages.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", i), "type": "function",
                    "function": {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = [_chat_part(part) for part in output]
            elif not isinstance(output, str):
                raise ValueError(f"input[{i}].output must be a string or a list of text parts")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": output})
        elif kind != "reasoning":
            raise ValueError(f"input[{i}]: items of type {kind!r} are not served (messages, function_call and "
                             "function_call_output are)")
    return messages


def _chat_part(part: Any) -> Any:
    """A Responses content part as chat's: text kinds become {"type": "text"}; any other part goes on
    as it is, for the chat endpoint to refuse by its type."""
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text") and "text" in part:
        return {"type": "text", "text": part["text"]}
    if isinstance(part, dict) and part.get("type") == "refusal" and "refusal" in part:
        return {"type": "text", "text": part["refusal"]}
    return part


def _text(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"input[{i}].{name} must be a string")
    return value


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    thinking = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat_usage.get("prompt_tokens", 0), "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": thinking}, "total_tokens": chat_usage.get("total_tokens", 0)}


@dataclass
class ResponseBuilder:
    """One Response as it is built from a chat answer: whole (`from_completion`), or chunk by chunk
    (`start`, `feed`, `finish`), which return the stream's events in order."""

    echo: dict[str, Any]
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    model: str | None = None
    output: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    assistant: dict[str, Any] = field(default_factory=lambda: {"role": "assistant", "content": None})
    sequence: int = 0
    _message: dict[str, Any] | None = None  # the message item being streamed
    _reasoning: dict[str, Any] | None = None  # a reasoning model's thinking (--reasoning-parser), before the message
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # chat tool call index -> its item
    _finish_reason: str | None = None

    def response(self) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "error": self.error, "incomplete_details": self.incomplete_details, "model": self.model,
                "output": self.output, "usage": self.usage, **self.echo}

    def from_completion(self, completion: dict[str, Any]) -> dict[str, Any]:
        self.model = completion.get("model")
        choice = (completion.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        content, calls = message.get("content"), message.get("tool_calls") or []
        if message.get("reasoning_content") is not None:
            self._open_reasoning()
            self._reasoning["content"][0]["text"] = message["reasoning_content"]
        if content or not calls:
            self._open_message()
            self._message["content"][0]["text"] = content or ""
            self._message["content"][0]["logprobs"] = list((choice.get("logprobs") or {}).get("content") or [])
        for index, call in enumerate(calls):
            self._open_call(index, call)
            self._calls[index]["arguments"] = (call.get("function") or {}).get("arguments") or ""
        self.usage = usage(completion.get("usage"))
        self._close(choice.get("finish_reason"))
        return self.response()

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk makes; an error chunk fails the response."""
        if "error" in chunk:
            error = chunk["error"]
            return self.fail(error if isinstance(error, dict) else {"message": str(error)})
        self.model = chunk.get("model", self.model)
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"])
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            logprobs = list((choice.get("logprobs") or {}).get("content") or [])
            if delta.get("reasoning_content"):
                if self._reasoning is None:
                    events += self._open_reasoning()
                self._reasoning["content"][0]["text"] += delta["reasoning_content"]
                events.append(self._event("response.reasoning_text.delta", **self._where(self._reasoning),
                                          content_index=0, delta=delta["reasoning_content"]))
            if delta.get("content") or logprobs:
                if self._message is None:
                    events += self._open_message()
                part = self._message["content"][0]
                part["text"] += delta.get("content") or ""
                part["logprobs"] += logprobs
                events.append(self._event("response.output_text.delta", **self._where(self._message),
                                          content_index=0, delta=delta.get("content") or "", logprobs=logprobs))
            for call in delta.get("tool_calls") or []:
                index = call.get("index", len(self._calls))
                if index not in self._calls:
                    events += self._open_call(index, call)
                item = self._calls[index]
                arguments = (call.get("function") or {}).get("arguments") or ""
                if arguments:
                    item["arguments"] += arguments
                    events.append(self._event("response.function_call_arguments.delta", **self._where(item),
                                              delta=arguments))
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The closing events: every open item done, then the response completed (or incomplete)."""
        if self.status == "failed":
            return []
        # an empty answer is still a message, as whole answers have one
        events = [] if self._message is not None or self._calls else self._open_message()
        for item in self.output:
            if item["type"] == "reasoning":
                part = item["content"][0]
                events.append(self._event("response.reasoning_text.done", **self._where(item), content_index=0,
                                          text=part["text"]))
                events.append(self._event("response.content_part.done", **self._where(item), content_index=0,
                                          part=part))
            elif item["type"] == "message":
                part = item["content"][0]
                events.append(self._event("response.output_text.done", **self._where(item), content_index=0,
                                          text=part["text"], logprobs=part["logprobs"]))
                events.append(self._event("response.content_part.done", **self._where(item), content_index=0,
                                          part=part))
            else:
                events.append(self._event("response.function_call_arguments.done", **self._where(item),
                                          arguments=item["arguments"]))
        self._close(self._finish_reason)
        for index, item in enumerate(self.output):
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self.response())]

    def translate_error(self, body: dict[str, Any], status: int) -> dict[str, Any]:
        """An error answer as the Responses API names its parameters."""
        param = body["error"].get("param")
        return {"error": {**body["error"], "param": PARAM_NAMES.get(param, param)}}

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        self.status = "failed"
        code = error.get("code") or error.get("type")
        self.error = {"code": str(code) if code is not None else "server_error", "message": error.get("message", "")}
        return [self._event("error", code=self.error["code"], message=self.error["message"],
                            param=PARAM_NAMES.get(error.get("param"), error.get("param"))),
                self._event("response.failed", response=self.response())]

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                         "content": []}
        return self._open_with_part(self._message, {"type": "output_text", "text": "", "annotations": [],
                                                    "logprobs": []})

    def _open_reasoning(self) -> list[dict[str, Any]]:
        """The thinking as OpenAI gives open-weight models': a reasoning item whose content is the text."""
        self._reasoning = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                           "status": "in_progress"}
        return self._open_with_part(self._reasoning, {"type": "reasoning_text", "text": ""})

    def _open_with_part(self, item: dict[str, Any], part: dict[str, Any]) -> list[dict[str, Any]]:
        """An item added to the output with its one content part, and the two events saying so."""
        self.output.append(item)
        added = self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        item["content"].append(part)
        return [added, self._event("response.content_part.added", **self._where(item), content_index=0, part=part)]

    def _open_call(self, index: int, call: dict[str, Any]) -> list[dict[str, Any]]:
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call.get("id") or new_id("call"),
                "name": (call.get("function") or {}).get("name", ""), "arguments": "", "status": "in_progress"}
        self._calls[index] = item
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _close(self, finish_reason: str | None) -> None:
        """Final statuses, and the answer as the chat message a later turn replays."""
        if finish_reason in ("length", "content_filter"):
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens" if finish_reason == "length" else finish_reason}
        else:
            self.status = "completed"
        for item in self.output:
            item["status"] = "incomplete" if item["type"] == "message" and self.status == "incomplete" else "completed"
        if self._message is not None and self._message["content"][0]["text"]:
            self.assistant["content"] = self._message["content"][0]["text"]
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        if calls:
            self.assistant["tool_calls"] = calls
        elif self.assistant["content"] is None:
            self.assistant["content"] = ""

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        # a snapshot: items and parts change after their event is made
        event = {"type": kind, "sequence_number": self.sequence,
                 **{name: copy.deepcopy(value) if isinstance(value, dict | list) else value
                    for name, value in fields.items()}}
        self.sequence += 1
        return event


class ResponsesAPI:
    """/v1/responses (and GET / DELETE /v1/responses/{id}, GET .../input_items) in front of an app that
    serves /v1/chat/completions. `governor`: the app's API keys, which scope the stored responses."""

    def __init__(self, app, governor=None, store_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.app, self.governor = app, governor
        self.store = ResponseStore(store_bytes)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PATH or path.startswith(PATH + "/")):
            return await self.app(scope, receive, send)
        try:
            owner = ""
            if self.governor is not None:
                key = self.governor.identify(scope)
                owner = f"key:{key.name}" if key is not None else ""
            response_id, _, tail = path[len(PATH) + 1:].partition("/")
            method = scope["method"]
            if path == PATH and method == "POST":
                return await self._create(scope, receive, send, owner)
            if response_id and not tail and method == "GET":
                return await send_json(send, 200, self.store.get(owner, response_id).response)
            if response_id and not tail and method == "DELETE":
                self.store.delete(owner, response_id)
                return await send_json(send, 200, {"id": response_id, "object": "response", "deleted": True})
            if response_id and tail == "input_items" and method == "GET":
                items = [{"id": f"{response_id}_in{i}", **item}
                         for i, item in enumerate(self.store.get(owner, response_id).items)]
                return await send_json(send, 200, {"object": "list", "data": items, "has_more": False,
                                                   "first_id": items[0]["id"] if items else None,
                                                   "last_id": items[-1]["id"] if items else None})
            raise APIError(404 if response_id or method == "GET" else 405, f"no route {method} {path}")
        except APIError as error:
            await send_json(send, error.status, error.body(), error.headers)

    async def _create(self, scope, receive, send, owner: str) -> None:
        body = await read_json(receive)
        try:
            request = ResponsesRequest.model_validate(body)
        except ValidationError as invalid:
            return await send_json(send, 400, validation_body(invalid.errors()))
        reason = request.refused()
        if reason is not None:
            raise APIError(400, reason)
        history = self.store.conversation(owner, request.previous_response_id) if request.previous_response_id else []
        items = input_items(request.input)
        try:
            turn = chat_messages(items)
        except ValueError as error:
            raise APIError(400, str(error), param="input") from None
        if not turn:
            raise APIError(400, "input holds no message", param="input")
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        builder = ResponseBuilder(request.echo())
        await call_app(self.app, scope, receive, send, request.chat_body(body, system + history + turn), builder)
        if request.store and builder.status in ("completed", "incomplete"):
            self.store.put(StoredResponse(owner, request.previous_response_id, turn + [builder.assistant], items,
                                          builder.response()))

"""Between OpenAI's two response shapes: a complete answer replayed as server-sent events (a cached
answer to a streaming client), and streamed chunks folded back into a complete answer (so a
streamed miss can be cached)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hyperserve.common.sse import DONE, sse_event


def replay(body: dict[str, Any], chat: bool, include_usage: bool) -> Iterator[str]:
    """SSE events equivalent to the complete response `body`, then [DONE]."""
    base = {"id": body.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body.get("created"), "model": body.get("model")}
    choices = body.get("choices") or []
    if chat:
        yield sse_event({**base, "choices": [{"index": c.get("index", 0), "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None} for c in choices]})
        yield sse_event({**base, "choices": [{"index": c.get("index", 0), "delta": _delta(c.get("message") or {}),
                                        "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")}
                                       for c in choices]})
    else:
        yield sse_event({**base, "choices": [{"index": c.get("index", 0), "text": c.get("text", ""),
                                        "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")}
                                       for c in choices]})
    if include_usage and body.get("usage") is not None:
        yield sse_event({**base, "choices": [], "usage": body["usage"]})
    yield sse_event(DONE)


def _delta(message: dict[str, Any]) -> dict[str, Any]:
    """A whole message as one delta: its content, a reasoning model's thinking, and its tool calls,
    each with its index."""
    delta: dict[str, Any] = {"content": message.get("content") or ""}
    if message.get("reasoning_content") is not None:
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    return delta


class StreamAccumulator:
    """Feed it each SSE chunk; `response()` is the complete answer once every choice finished."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.meta: dict[str, Any] = {}
        self.texts: dict[int, list[str]] = {}
        self.thoughts: dict[int, list[str]] = {}  # a reasoning model's reasoning_content, where it sent any
        self.tool_calls: dict[int, dict[int, dict[str, Any]]] = {}  # choice -> call index -> call so far
        self.finish_reasons: dict[int, str | None] = {}
        self.logprobs: dict[int, dict[str, Any]] = {}  # choice -> its chunks' logprobs, lists joined
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if not self.meta:
            self.meta = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            self.texts.setdefault(index, []).append(text or "")
            thought = (choice.get("delta") or {}).get("reasoning_content") if self.chat else None
            if thought is not None:
                self.thoughts.setdefault(index, []).append(thought)
            calls = (choice.get("delta") or {}).get("tool_calls") if self.chat else None
            for call in calls or []:
                self._add_call(self.tool_calls.setdefault(index, {}), call)
            if choice.get("logprobs"):
                self._add_logprobs(self.logprobs.setdefault(index, {}), choice["logprobs"])
            if choice.get("finish_reason") is not None:
                self.finish_reasons[index] = choice["finish_reason"]
            else:
                self.finish_reasons.setdefault(index, None)

    @staticmethod
    def _add_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
        """OpenAI streams a call as deltas: the first has its id and name, later ones more arguments."""
        call = calls.setdefault(delta.get("index", 0), {"id": None, "type": "function",
                                                        "function": {"name": "", "arguments": ""}})
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""

    @staticmethod
    def _add_logprobs(joined: dict[str, Any], chunk: dict[str, Any]) -> None:
        """Chat's `content` (and `refusal`) lists, a completion's `tokens`, `token_logprobs`,
        `top_logprobs` and `text_offset` (counted from the completion's start): each chunk's
        entries follow the last."""
        for key, value in chunk.items():
            if isinstance(value, list):
                joined.setdefault(key, []).extend(value)
            elif key not in joined:
                joined[key] = value

    def response(self) -> dict[str, Any] | None:
        """None unless every choice finished normally (an interrupted stream is never cached)."""
        finished = ("stop", "length", "tool_calls")
        if not self.texts or any(self.finish_reasons.get(i) not in finished for i in self.texts):
            return None
        choices = []
        for index in sorted(self.texts):
            text = "".join(self.texts[index])
            content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            if index in self.thoughts:
                content["message"]["reasoning_content"] = "".join(self.thoughts[index])
            if index in self.tool_calls:
                calls = self.tool_calls[index]
                content["message"]["tool_calls"] = [calls[i] for i in sorted(calls)]
                content["message"]["content"] = text or None
            choices.append({"index": index, **content, "logprobs": self.logprobs.get(index),
                            "finish_reason": self.finish_reasons[index]})
        return {**self.meta, "object": "chat.completion" if self.chat else "text_completion", "choices": choices,
                "usage": self.usage}

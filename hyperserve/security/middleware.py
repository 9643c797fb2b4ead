"""The security layer, as ASGI middleware shared by `hyperserve serve` and `hyperserve gateway`.

Per completion request, before any engine work: API key (401) -> allowed model (403) -> size limits
(400 naming the limit) -> guardrails on the request (injection, PII: 400 `content_blocked`, or
redaction of the body the model sees) -> rate limits and budget (429 with Retry-After and
x-ratelimit-* headers). The answer then passes through the response guardrails (PII redaction,
streamed too), its usage settles the token accounting, and one audit line is written.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from hyperserve.common.asgi import is_event_stream, read_body, replay, send_json, without_content_length
from hyperserve.common.errors import APIError
from hyperserve.common.messages import message_text
from hyperserve.common.request_log import RequestLog
from hyperserve.common.sse import DONE, EventSplitter, parse_sse_data, sse_event
from hyperserve.security.config import Guardrails, KeyEntry, Limits, SecurityConfig, hash_key
from hyperserve.security.limits import InProcessLimiter, RateLimited, RedisLimiter
from hyperserve.security.pii import Finding, Redactor, StreamRedactor, find_pii

logger = logging.getLogger("hyperserve.security")

# Requests that make a model work: completions, prefix pins (which hold KV like a request) and the encoder's
# embeddings, scores and rerankings.
ENCODER_PATHS = ("/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank")
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/cache", *ENCODER_PATHS)
OPEN_PATHS = ("/health", "/ping", "/version", "/")  # and the web pages under /ui/, which ask for a key
MODEL_ADMIN_PATH = re.compile(r"/v1/models/([^/]+)/(?:load|unload)")
# A Batch API line's scope holds its batch creator's key as this (the key's SHA-256): set in process by
# common/batch_api.py, which authenticated the creator, and never from a client's request
KEY_DIGEST = "hyperserve.key_digest"
DEFAULT_MAX_TOKENS = 256  # the estimate for a request that sets no max_tokens


def estimate_tokens(text: str) -> int:
    """About 4 characters per token for English; used for limits before the model tokenizes."""
    return math.ceil(len(text) / 4)


@dataclass
class Guard:
    """One request's state through the layer."""

    key: KeyEntry | None
    guardrails: Guardrails
    redactor: Redactor = field(default_factory=Redactor)  # the request's values: restorable
    answer_redactor: Redactor | None = None  # continues its numbering over the model's own values
    verdicts: dict[str, Any] = field(default_factory=dict)
    response_findings: list[Finding] = field(default_factory=list)

    def filter_text(self, text: str, findings: list[Finding]) -> str:
        """Response text as the caller may see it: the model's own PII redacted (or only logged),
        then the caller's own redacted values restored if configured."""
        self.response_findings += findings
        if self.guardrails.pii_response == "redact" and findings:
            if self.answer_redactor is None:
                self.answer_redactor = Redactor(dict(self.redactor.placeholders), dict(self.redactor.counts))
            text = self.answer_redactor.redact(text, findings)
        if self.guardrails.reversible_redaction:
            text = self.redactor.restore(text)
        return text


class Governor:
    """Keys, limiters, detectors and the audit log, built once from the config."""

    def __init__(self, config: SecurityConfig) -> None:
        self.config = config
        self.keys = {k.sha256: k for k in config.keys}
        self.limiter = (RedisLimiter(config.redis_url, config.redis_prefix, timeout_s=config.redis_timeout_s,
                                     fail_open=config.redis_unavailable == "open")
                        if config.redis_url else InProcessLimiter())
        self.audit = RequestLog(config.audit_log)
        uses_injection = any(g.injection != "off" for g in self._all_guardrails())
        self.injection = None
        if uses_injection:
            from hyperserve.security.injection import InjectionDetector

            self.injection = InjectionDetector()

    def _all_guardrails(self) -> list[Guardrails]:
        c = self.config
        return [c.guardrails, *c.model_guardrails.values(), *(k.guardrails for k in c.keys if k.guardrails)]

    @property
    def needs_http(self) -> bool:
        """Limits or guardrails are configured: they are enforced on HTTP requests only."""
        limits = [self.config.defaults] + [k.limits for k in self.config.keys if k.limits]
        guardrails = self._all_guardrails()
        return (any(v is not None for lim in limits for k, v in lim if k != "budget_period_s")
                or any(g.injection != "off" or g.pii_request != "off" or g.pii_response != "off"
                       for g in guardrails))

    def identify(self, scope) -> KeyEntry | None:
        """An HTTP request's key: its headers' (authenticate), or for a Batch API line the key whose
        SHA-256 it carries (KEY_DIGEST); raises 401, for a batch's key if it was taken out of the
        keys since the batch began."""
        if KEY_DIGEST not in scope:
            return self.authenticate(dict(scope["headers"]))
        if not self.keys:
            return None
        entry = self.keys.get(scope[KEY_DIGEST])
        if entry is None:
            raise APIError(401, "the batch's API key is no longer accepted", type_="authentication_error",
                           code="invalid_api_key")
        return entry

    def authenticate(self, headers: dict[bytes, bytes]) -> KeyEntry | None:
        """The key's entry; raises 401. Compared as digests, in constant time."""
        if not self.keys:
            return None
        auth = headers.get(b"authorization", b"").decode(errors="replace")
        if auth.lower().startswith("bearer "):
            presented = auth[7:].strip()
        else:
            presented = headers.get(b"x-api-key", b"").decode()
        if not presented:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           type_="authentication_error", code="missing_api_key")
        digest = hash_key(presented)
        entry = self.keys.get(digest)
        if entry is None or not hmac.compare_digest(entry.sha256, digest):
            raise APIError(401, "incorrect API key provided", type_="authentication_error",
                           code="invalid_api_key")
        return entry

    def limits(self, key: KeyEntry | None) -> Limits:
        return key.limits if key is not None and key.limits is not None else self.config.defaults

    def guardrails(self, key: KeyEntry | None, model: Any) -> Guardrails:
        """The key's own, else the model's (route's), else the default."""
        if key is not None and key.guardrails is not None:
            return key.guardrails
        return self.config.model_guardrails.get(model, self.config.guardrails) if isinstance(model, str) \
            else self.config.guardrails

    def check_model(self, key: KeyEntry | None, model: Any) -> None:
        if key is not None and key.models is not None and model not in key.models:
            raise APIError(403, f"the key {key.name!r} may not use model {model!r}; allowed: {key.models}",
                           type_="permission_error", param="model", code="model_not_allowed")

    def check_request(self, key: KeyEntry | None, body: dict[str, Any], chat: bool) -> int:
        """Model permission and size limits; returns the estimated prompt tokens."""
        self.check_model(key, body.get("model"))
        limits = self.config.request_limits
        messages = body.get("messages") if chat else None
        if isinstance(messages, list) and len(messages) > limits.max_messages:
            raise APIError(400, f"{len(messages)} messages exceed the limit of {limits.max_messages} "
                           "(max_messages)", param="messages", code="request_too_large")
        n = _count(body.get("n")) or 1
        if n > limits.max_n:
            raise APIError(400, f"n={n} exceeds the limit of {limits.max_n} (max_n)", param="n",
                           code="request_too_large")
        max_tokens = _max_tokens(body)
        if limits.max_tokens and max_tokens is not None and max_tokens > limits.max_tokens:
            raise APIError(400, f"max_tokens={max_tokens} exceeds the limit of {limits.max_tokens} "
                           "(max_tokens)", param="max_tokens", code="request_too_large")
        prompt_tokens = estimate_tokens(" ".join(_texts(body, chat))) + _num_prompt_token_ids(body, chat)
        if limits.max_prompt_tokens and prompt_tokens > limits.max_prompt_tokens:
            raise APIError(400, f"the prompt has about {prompt_tokens} tokens, over the limit of "
                                f"{limits.max_prompt_tokens} (max_prompt_tokens)",
                           param="messages" if chat else "prompt", code="request_too_large")
        return prompt_tokens

    async def guard_request(self, guard: Guard, body: dict[str, Any], chat: bool) -> None:
        """Request guardrails; may redact `body` in place. Raises 400 content_blocked."""
        g = guard.guardrails
        if g.injection != "off" and self.injection is not None:
            inputs = _untrusted_inputs(body, chat)
            if inputs:
                verdict = await self.injection.judge_async(inputs, g.injection_threshold)
                guard.verdicts["injection"] = {"flagged": verdict.flagged,
                                               "probability": round(verdict.probability, 3),
                                               "pattern": verdict.pattern}
                if verdict.flagged and g.injection == "block":
                    raise APIError(400, "the request was blocked: it looks like a prompt injection "
                                        f"(classifier probability {verdict.probability:.2f})",
                                   code="content_blocked", param="messages" if chat else "prompt")
        if g.pii_request != "off":
            # up to the body limit: off the event loop
            kinds = await asyncio.to_thread(_scan_pii, guard, body, chat)
            guard.verdicts["pii_request"] = kinds
            if kinds and g.pii_request == "block":
                raise APIError(400, f"the request was blocked: it contains {', '.join(kinds)}",
                               code="content_blocked", param="messages" if chat else "prompt")


def _scan_pii(guard: Guard, body: dict[str, Any], chat: bool) -> list[str]:
    """The kinds of PII in the request's texts, redacting them in place if the guardrail says so."""
    kinds: set[str] = set()
    for holder, field_name in _text_fields(body, chat):
        findings = find_pii(holder[field_name])
        kinds.update(f.kind for f in findings)
        if findings and guard.guardrails.pii_request == "redact":
            holder[field_name] = guard.redactor.redact(holder[field_name], findings)
    return sorted(kinds)


def add_security(app, governor: Governor | None) -> None:
    """API keys, limits and guardrails in front of an app (the server's or the gateway's)."""
    if governor is not None:
        app.add_middleware(SecurityMiddleware, governor=governor)


class SecurityMiddleware:
    def __init__(self, app, governor: Governor) -> None:
        self.app, self.governor = app, governor

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["path"].startswith("/ui/") or (
                scope["path"] == "/metrics" and not self.governor.config.protect_metrics):
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        try:
            key = self.governor.identify(scope)
            # whose request this is, for an app that hands it on (the Ray ingress, to its replicas)
            scope.setdefault("state", {})["key_digest"] = key.sha256 if key else None
            managed = MODEL_ADMIN_PATH.fullmatch(scope["path"])
            if managed is not None:  # loading or unloading a model takes the right to use it
                self.governor.check_model(key, managed.group(1))
            if scope["method"] != "POST" or scope["path"] not in COMPLETION_PATHS:
                return await self.app(scope, receive, send)
            await self._completion(scope, receive, send, key, started)
        except APIError as error:
            await send_json(send, error.status, error.body(), error.headers)
        except RateLimited as limited:
            body = APIError(429, limited.message, type_="rate_limit_error", code="rate_limit_exceeded").body()
            await send_json(send, 429, body, limited.headers)

    async def _websocket(self, scope, receive, send) -> None:
        """Keys apply; limits and guardrails need HTTP, so with either configured sockets are refused.
        A browser, which cannot set headers on a WebSocket, offers its key as the subprotocol
        `bearer.<key>` (beside `hyperserve`, the one the server accepts)."""
        headers = dict(scope["headers"])
        for protocol in headers.get(b"sec-websocket-protocol", b"").split(b","):
            protocol = protocol.strip()
            if protocol.startswith(b"bearer.") and b"authorization" not in headers:
                headers[b"authorization"] = b"Bearer " + protocol[len(b"bearer."):]
        try:
            key = self.governor.authenticate(headers)
        except APIError:
            return await send({"type": "websocket.close", "code": 1008, "reason": "invalid API key"})
        state = scope.setdefault("state", {})  # as for HTTP requests
        state["cache_scope"], state["key_digest"] = (key.scope, key.sha256) if key else (None, None)
        if self.governor.needs_http:
            return await send({"type": "websocket.close", "code": 1008,
                               "reason": "use HTTP: rate limits and guardrails apply to HTTP requests"})
        await self.app(scope, receive, send)

    async def _completion(self, scope, receive, send, key: KeyEntry | None, started: float) -> None:
        governor = self.governor
        raw = await read_body(receive)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):  # malformed: the app gives the proper 400
            return await self.app(scope, replay(raw, receive), send)
        scope.setdefault("state", {})["cache_scope"] = key.scope if key else None  # request.state for the app
        pin, embed = scope["path"] == "/v1/cache", scope["path"] in ENCODER_PATHS
        chat = scope["path"] == "/v1/chat/completions" or (pin and "messages" in body)
        prompt_tokens = governor.check_request(key, body, chat)
        guardrails = governor.guardrails(key, body.get("model"))
        if embed:  # an encoder follows no instructions: only the PII rules apply
            guardrails = guardrails.model_copy(update={"injection": "off"})
        guard = Guard(key, guardrails)
        record: dict[str, Any] = {"key": key.name if key else None, "path": scope["path"],
                                  "model": body.get("model")}
        if governor.config.audit_prompts:
            record["prompt"] = _texts(body, chat)
        n = _count(body.get("n")) or 1
        max_tokens = 0 if embed else 1 if pin else _max_tokens(body) or DEFAULT_MAX_TOKENS
        estimate = prompt_tokens + max_tokens * n
        try:
            await governor.guard_request(guard, body, chat)
            grant = await governor.limiter.acquire(key.name if key else "anonymous", governor.limits(key),
                                                   estimate)
        except (APIError, RateLimited) as refusal:
            governor.audit.write({**record, "status": getattr(refusal, "status", 429),
                                  "verdicts": guard.verdicts, "refused": str(refusal)})
            raise
        stream = body.get("stream") is True
        client_wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if stream:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        relay = _ResponseRelay(send, guard, grant.headers, chat, stream, client_wants_usage)
        try:
            await self.app(scope, replay(json.dumps(body).encode(), receive), relay.send)
        finally:
            used = relay.usage.get("total_tokens") if relay.usage else None
            await governor.limiter.release(grant, used if isinstance(used, int) else estimate)
            guard.verdicts["pii_response"] = sorted({f.kind for f in guard.response_findings})
            governor.audit.write({**record, "status": relay.status, "stream": stream,
                                  "latency_ms": round((time.perf_counter() - started) * 1000, 2),
                                  "tokens": {"prompt": (relay.usage or {}).get("prompt_tokens"),
                                             "completion": (relay.usage or {}).get("completion_tokens")},
                                  "verdicts": guard.verdicts})


class _ResponseRelay:
    """Wraps the app's `send`: adds rate-limit headers, filters answer text, records usage."""

    def __init__(self, send, guard: Guard, headers: dict[str, str], chat: bool, stream: bool,
                 client_wants_usage: bool) -> None:
        self._send, self.guard, self.headers = send, guard, headers
        self.chat, self.stream, self.client_wants_usage = chat, stream, client_wants_usage
        self.status = 0
        self.usage: dict[str, Any] | None = None
        self._start: dict[str, Any] | None = None
        self._is_sse = False
        self._buffer = b""  # a JSON answer's body so far
        self._events_in = EventSplitter()  # a streamed one's events
        self._redactors: dict[int, StreamRedactor] = {}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            extra = [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
            headers = without_content_length(message.get("headers", [])) + extra
            self._is_sse = is_event_stream(message.get("headers", []))
            self._start = {**message, "headers": headers}
            if self._is_sse:
                await self._send(self._start)
            return
        if message["type"] != "http.response.body":
            return await self._send(message)
        body, more = message.get("body", b""), message.get("more_body", False)
        if self._is_sse:
            out = b"".join(self._event(event) for event in self._events_in.feed(body, final=not more))
            await self._send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._buffer += body
        if more:
            return
        body = self._buffer
        if self.status == 200:
            body = self._filter_json(body)
        self._start["headers"].append((b"content-length", str(len(body)).encode()))
        await self._send(self._start)
        await self._send({"type": "http.response.body", "body": body})

    def _filter_json(self, raw: bytes) -> bytes:
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError):
            return raw
        self.usage = answer.get("usage")
        for choice in answer.get("choices") or []:
            holder = choice.get("message") if self.chat else choice
            if isinstance(holder, dict) and isinstance(holder.get("content" if self.chat else "text"), str):
                name = "content" if self.chat else "text"
                holder[name] = self.guard.filter_text(holder[name], find_pii(holder[name]))
        return json.dumps(answer).encode()

    def _event(self, event: bytes) -> bytes:
        data = parse_sse_data(event.decode(errors="replace").strip())
        if data is None or data == DONE:
            return event + b"\n\n"
        try:
            chunk = json.loads(data)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(chunk, dict):
            return event + b"\n\n"
        if chunk.get("usage"):
            self.usage = chunk["usage"]
            if not chunk.get("choices") and not self.client_wants_usage:
                return b""
        for choice in chunk.get("choices") or []:
            holder = choice.get("delta") if self.chat else choice
            name = "content" if self.chat else "text"
            if not isinstance(holder, dict):
                continue
            redactor = self._redactors.setdefault(choice.get("index", 0),
                                                  StreamRedactor(self.guard.filter_text))
            piece = redactor.feed(holder.get(name) or "")
            if choice.get("finish_reason") is not None:
                piece += redactor.flush()
            if name in holder or piece:
                holder[name] = piece
        return sse_event(chunk).encode()


def _count(value: Any) -> int | None:
    """A count as the server will read it: pydantic's lax mode takes 128, 128.0 and "128" alike,
    so a limit that only looked at ints could be stepped around with a string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _max_tokens(body: dict[str, Any]) -> int | None:
    return _count(body.get("max_completion_tokens")) or _count(body.get("max_tokens"))


def _num_prompt_token_ids(body: dict[str, Any], chat: bool) -> int:
    """Prompt tokens sent as ids (a list of ints, or of lists of ints), which `_texts` cannot see."""
    prompt = None if chat else body.get("prompt")
    if not isinstance(prompt, list):
        return 0
    return sum(1 if isinstance(p, int) else len(p) if isinstance(p, list) else 0 for p in prompt)


def _texts(body: dict[str, Any], chat: bool) -> list[str]:
    return [holder[name] for holder, name in _text_fields(body, chat)]


def _text_fields(body: dict[str, Any], chat: bool) -> list[tuple[dict | list, Any]]:
    """(container, key) of every text the model will read, so a guardrail can rewrite it in place."""
    fields: list[tuple[dict | list, Any]] = []
    if chat:
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                fields.append((message, "content"))
            elif isinstance(content, list):
                fields += [(part, "text") for part in content if isinstance(part, dict)
                           and isinstance(part.get("text"), str)]
    else:  # a completion's prompts, an embedding request's inputs, a score's or a reranking's texts
        for name in ("prompt", "input", "text_1", "text_2", "query", "documents"):
            value = body.get(name)
            if isinstance(value, str):
                fields.append((body, name))
            elif isinstance(value, list):
                fields += [(value, i) for i, item in enumerate(value) if isinstance(item, str)]
                fields += [(item, "text") for item in value
                           if isinstance(item, dict) and isinstance(item.get("text"), str)]
    return fields


def _untrusted_inputs(body: dict[str, Any], chat: bool) -> list[str]:
    """What the injection check reads: every user and tool message (an earlier turn may carry the
    attack, and tool results carry indirect ones), or the prompts."""
    if not chat:
        return _texts(body, chat)
    return [message_text(m.get("content"), strict=False, separator=" ") for m in body.get("messages") or []
            if isinstance(m, dict) and m.get("role") in ("user", "tool")]


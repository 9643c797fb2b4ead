"""OpenAI's Batch API (/v1/files and /v1/batches) in front of an app that serves the endpoints.

A client uploads a JSONL file of requests (`{"custom_id", "method": "POST", "url", "body"}`), creates
a batch over it, polls it, and downloads its output and error files, with OpenAI's own SDK:
`client.files.create(file=..., purpose="batch")`, `client.batches.create(input_file_id=...,
endpoint="/v1/chat/completions", completion_window="24h")`, `client.files.content(output_file_id)`.

Each line re-enters the app at its endpoint with the batch creator's API key, so keys, rate limits,
guardrails and validation apply to it as to any request, and its answer or error is what that request
would get. Lines run in the background, a few at a time (`LineSlots`, shared by all batches): many
while the app serves nothing else, two while it does and for a few seconds after. In
the server they run at a low priority (BATCH_PRIORITY): its engine schedules interactive requests
first and preempts batch ones first. The gateway sets none, since OpenAI's API and vLLM's default
scheduler take no `priority`. A line answered 429 or 503 waits its Retry-After and tries again until
the batch's window ends. Files are kept on disk (`files_dir`); batches in memory, so a restart loses
the ones in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.requests import Request

from hyperserve.common.asgi import replay, send_json
from hyperserve.common.chat_translation import read_json
from hyperserve.common.errors import APIError

FILES, BATCHES = "/v1/files", "/v1/batches"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PRIORITY_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # those whose body takes `priority`
BATCH_PRIORITY = 100  # lower runs first; interactive requests default to 0
WINDOW_S = 24 * 3600  # completion_window "24h", the only one OpenAI offers
MAX_LINES = 50_000  # per batch, as OpenAI's
QUIET_S = 5.0  # after the last other request, how long batch lines stay at the busy limit
MAX_ACTIVE_BATCHES = 64  # running at once on a server, all owners together
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
MAX_FILE_BYTES = 200 * 2**20
MAX_CREATE_BYTES = 64 * 1024  # a batch's own request (the file id, the endpoint, metadata)
CHUNK_BYTES = 2**20
FORWARDED_HEADERS = (b"authorization", b"x-api-key")  # a line is sent with its batch creator's key


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class StoredFile:
    id: str
    owner: str  # the API key that uploaded (or whose batch wrote) it ("" without keys)
    filename: str
    purpose: str  # batch (an input), batch_output
    path: Path
    bytes: int
    created_at: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None}


class FileStore:
    """Files on disk, each visible to its owner alone; `max_bytes` is what they may hold together."""

    def __init__(self, directory: Path | None, max_bytes: int) -> None:
        self._temporary = None if directory is not None else tempfile.TemporaryDirectory(prefix="hyperserve-files-")
        self.directory = Path(directory or self._temporary.name)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.files: dict[str, StoredFile] = {}

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def add(self, owner: str, filename: str, purpose: str, data: bytes) -> StoredFile:
        if self.bytes + len(data) > self.max_bytes:
            raise APIError(400, f"the server's files would hold more than {self.max_bytes} bytes; delete some first",
                           code="storage_full")
        file_id = _new_id("file")
        path = self.directory / file_id
        path.write_bytes(data)
        stored = StoredFile(file_id, owner, filename, purpose, path, len(data))
        self.files[file_id] = stored
        return stored

    def get(self, owner: str, file_id: str, param: str = "file_id") -> StoredFile:
        stored = self.files.get(file_id)
        if stored is None or stored.owner != owner:
            raise APIError(404, f"no file {file_id!r}", param=param, code="file_not_found")
        return stored

    def delete(self, owner: str, file_id: str) -> None:
        self.get(owner, file_id).path.unlink(missing_ok=True)
        del self.files[file_id]


@dataclass
class Batch:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    metadata: dict[str, str] | None
    status: str = "validating"  # -> in_progress -> finalizing -> completed | failed | cancelling -> cancelled | expired
    errors: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict[str, int] = field(default_factory=lambda: {"created_at": int(time.time())})
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    @property
    def expires_at(self) -> int:
        return self.times["created_at"] + WINDOW_S

    def card(self) -> dict[str, Any]:
        stamps = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                  "cancelling_at", "cancelled_at")
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "input_file_id": self.input_file_id,
                "completion_window": "24h", "status": self.status,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "expires_at": self.expires_at, **{stamp: self.times.get(stamp) for stamp in stamps},
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.metadata}


def read_lines(data: bytes, endpoint: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the requests, the errors) of an input file: each line a JSON object with a unique string
    custom_id, method POST, the batch's endpoint as url, and an object body."""
    requests, errors, seen = [], [], set()
    for number, line in enumerate(data.decode(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except (ValueError, RecursionError):
            request = None
        problem = None
        if not isinstance(request, dict):
            problem = "the line is not a JSON object"
        elif not isinstance(request.get("custom_id"), str) or not request["custom_id"]:
            problem = "custom_id must be a non-empty string"
        elif request["custom_id"] in seen:
            problem = f"custom_id {request['custom_id']!r} appears twice"
        elif request.get("method") != "POST":
            problem = "method must be POST"
        elif request.get("url") != endpoint:
            problem = f"url must be the batch's endpoint, {endpoint}"
        elif not isinstance(request.get("body"), dict):
            problem = "body must be a JSON object"
        if problem is not None:
            errors.append({"code": "invalid_request", "message": problem, "param": None, "line": number})
            continue
        seen.add(request["custom_id"])
        requests.append(request)
    if not requests and not errors:
        errors.append({"code": "empty_file", "message": "the input file holds no request", "param": None,
                       "line": None})
    if len(requests) > MAX_LINES:
        errors.append({"code": "too_many_requests", "message": f"a batch takes at most {MAX_LINES} requests",
                       "param": None, "line": None})
    return requests, errors


class LineSlots:
    """How many batch lines may be in the app at once: `idle` while no other request is, `busy`
    while one is and for QUIET_S after the last ends. Interactive traffic so gets the engine back
    within a line's time, and batches fill it when nobody else uses it."""

    def __init__(self, idle: int, busy: int) -> None:
        self.idle, self.busy = idle, busy
        self.taken = 0
        self.others = 0  # requests in the app now that are not batch lines
        self.last_other = -math.inf  # when the last of them ended (time.monotonic)
        self._changed = asyncio.Condition()

    def _quiet_in(self) -> float | None:
        """Seconds until the idle limit applies (0: it does now; None: not while others run)."""
        if self.others:
            return None
        return max(QUIET_S - (time.monotonic() - self.last_other), 0.0)

    def limit(self) -> int:
        return self.idle if self._quiet_in() == 0 else self.busy

    @contextlib.asynccontextmanager
    async def line(self):
        """Around one batch line in the app."""
        async with self._changed:
            while self.taken >= self.limit():
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=self._quiet_in() or None)
                except TimeoutError:
                    pass
            self.taken += 1
        try:
            yield
        finally:
            async with self._changed:
                self.taken -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def other(self):
        """Around any other request in the app."""
        self.others += 1
        try:
            yield
        finally:
            self.others -= 1
            self.last_other = time.monotonic()
            async with self._changed:
                self._changed.notify_all()  # the waiters time their wait for the quiet period


class BatchAPI:
    """/v1/files and /v1/batches in front of `app`. `governor`: the app's API keys, which own files
    and batches; `concurrency` and `busy_concurrency`: how many lines of all batches are in the app at
    once while it serves nothing else, and while it does (LineSlots); `priority`: the
    one their bodies get where they set none (None: none, for backends that take no `priority`);
    `registry`: where the batch metrics go."""

    def __init__(self, app, governor=None, files_dir: Path | None = None, max_file_bytes: int = MAX_FILE_BYTES,
                 max_stored_bytes: int = 4 * 2**30, concurrency: int = 16, busy_concurrency: int = 2,
                 priority: int | None = BATCH_PRIORITY, registry: CollectorRegistry | None = None) -> None:
        self.app, self.governor, self.priority = app, governor, priority
        self.lines_done = Counter("hyperserve:batch_requests", "Batch lines ended, by outcome: answered (2xx), "
                                  "failed (any other status), not_run (the batch was cancelled or expired)",
                                  ["outcome"], registry=registry)
        Gauge("hyperserve:batches_running", "Batches validating, in progress, finalizing or cancelling",
              registry=registry).set_function(lambda: sum(b.status in ACTIVE for b in self.batches.values()))
        self.max_file_bytes = max_file_bytes
        self.store = FileStore(files_dir, max_stored_bytes)
        self.batches: dict[str, Batch] = {}
        self.slots = LineSlots(concurrency, min(busy_concurrency, concurrency))
        self._tasks: set[asyncio.Task] = set()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        kind = FILES if path == FILES or path.startswith(FILES + "/") else \
            BATCHES if path == BATCHES or path.startswith(BATCHES + "/") else None
        if scope["type"] != "http" or kind is None:
            if scope["type"] == "lifespan" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
                return await self.app(scope, receive, send)  # pages, health, metrics: no engine work
            async with self.slots.other():
                return await self.app(scope, receive, send)
        try:
            headers = dict(scope["headers"])
            key = self.governor.authenticate(headers) if self.governor is not None else None
            owner = f"key:{key.name}" if key is not None else ""
            name, _, tail = path[len(kind) + 1:].partition("/")
            query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
            if kind == FILES:
                return await self._files(scope, receive, send, owner, name, tail, query)
            return await self._batches(scope, receive, send, owner, name, tail, query)
        except APIError as error:
            await send_json(send, error.status, error.body(), error.headers)

    # ---- files ---------------------------------------------------------------------------------

    async def _files(self, scope, receive, send, owner: str, file_id: str, tail: str, query: dict) -> None:
        method = scope["method"]
        if not file_id and method == "POST":
            return await send_json(send, 200, (await self._upload(scope, receive, owner)).card())
        if not file_id and method == "GET":
            files = [f.card() for f in self.store.files.values()
                     if f.owner == owner and query.get("purpose", f.purpose) == f.purpose]
            return await send_json(send, 200, _page(sorted(files, key=lambda f: -f["created_at"]), query))
        if file_id and not tail and method == "GET":
            return await send_json(send, 200, self.store.get(owner, file_id).card())
        if file_id and not tail and method == "DELETE":
            self.store.delete(owner, file_id)
            return await send_json(send, 200, {"id": file_id, "object": "file", "deleted": True})
        if file_id and tail == "content" and method == "GET":
            return await _send_file(send, self.store.get(owner, file_id).path)
        raise APIError(404 if method == "GET" or file_id else 405, f"no route {method} {scope['path']}")

    async def _upload(self, scope, receive, owner: str) -> StoredFile:
        """A multipart upload (`file`, `purpose`), refused past max_file_bytes as it arrives."""
        too_large = APIError(413, f"files take at most {self.max_file_bytes} bytes", code="file_too_large")
        try:  # the form's own fields come besides the file
            form = await Request(scope, _limited(receive, self.max_file_bytes + 64 * 1024, too_large)).form(
                max_files=1, max_fields=8)
        except APIError:
            raise
        except Exception as error:  # noqa: BLE001 - a malformed body from the client: say why
            raise APIError(400, f"expected a multipart form with 'file' and 'purpose': {error}") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise APIError(400, "purpose must be 'batch': this server keeps files for the Batch API", param="purpose")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "the form holds no file", param="file")
        data = await upload.read()
        await form.close()
        if len(data) > self.max_file_bytes:
            raise too_large
        return self.store.add(owner, upload.filename or "upload.jsonl", purpose, data)

    # ---- batches -------------------------------------------------------------------------------

    async def _batches(self, scope, receive, send, owner: str, batch_id: str, tail: str, query: dict) -> None:
        method = scope["method"]
        if not batch_id and method == "POST":
            return await send_json(send, 200, (await self._create(scope, receive, owner)).card())
        if not batch_id and method == "GET":
            batches = [b.card() for b in reversed(self.batches.values()) if b.owner == owner]
            return await send_json(send, 200, _page(batches, query))
        batch = self.batches.get(batch_id)
        if batch is None or batch.owner != owner:
            raise APIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        if not tail and method == "GET":
            return await send_json(send, 200, batch.card())
        if tail == "cancel" and method == "POST":
            if batch.status in ("validating", "in_progress"):
                batch.enter("cancelling")
                batch.cancelled.set()
            return await send_json(send, 200, batch.card())
        raise APIError(404 if method == "GET" else 405, f"no route {method} {scope['path']}")

    async def _create(self, scope, receive, owner: str) -> Batch:
        body = await read_json(_limited(receive, MAX_CREATE_BYTES, APIError(413, "the request body is too large")))
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if window != "24h":
            raise APIError(400, "completion_window must be '24h'", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise APIError(400, "metadata holds at most 16 string keys (64 characters) and values (512)",
                           param="metadata")
        source = self.store.get(owner, str(body.get("input_file_id")), param="input_file_id")
        if source.purpose != "batch":
            raise APIError(400, "the input file must have been uploaded with purpose 'batch'", param="input_file_id")
        if sum(b.status in ACTIVE for b in self.batches.values()) >= MAX_ACTIVE_BATCHES:
            raise APIError(429, f"{MAX_ACTIVE_BATCHES} batches are running; retry once one has finished",
                           type_="rate_limit_error", headers={"Retry-After": "60"})
        batch = Batch(_new_id("batch"), owner, endpoint, source.id, metadata)
        self.batches[batch.id] = batch
        headers = [(k, v) for k, v in scope["headers"] if k.lower() in FORWARDED_HEADERS]
        task = asyncio.create_task(self._run(batch, source, scope, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return batch

    async def _run(self, batch: Batch, source: StoredFile, scope, headers: list[tuple[bytes, bytes]]) -> None:
        """Validate the input, run its lines, write the output and error files; anything that stops
        that (the input deleted meanwhile, the store full) fails the batch, saying why."""
        try:
            await self._process(batch, source, scope, headers)
        except Exception as error:  # noqa: BLE001 - the batch's own failure, reported on it
            message = error.message if isinstance(error, APIError) else f"{type(error).__name__}: {error}"
            batch.errors = [{"code": "batch_failed", "message": message, "param": None, "line": None}]
            batch.enter("failed")

    async def _process(self, batch: Batch, source: StoredFile, scope, headers: list[tuple[bytes, bytes]]) -> None:
        requests, errors = read_lines(await asyncio.to_thread(source.path.read_bytes), batch.endpoint)
        if errors:
            batch.errors = errors[:100]
            return batch.enter("failed")
        batch.total = len(requests)
        if not batch.cancelled.is_set():
            batch.enter("in_progress")
        results = await asyncio.gather(*(self._line(batch, request, scope, headers) for request in requests))
        if not batch.cancelled.is_set():
            batch.enter("finalizing")
        files: dict[str, list[dict[str, Any]]] = {"output": [], "error": []}
        for result in results:
            files["output" if _succeeded(result) else "error"].append(result)
        for kind, lines in files.items():
            if lines:
                data = "".join(json.dumps(line) + "\n" for line in lines).encode()
                stored = self.store.add(batch.owner, f"{batch.id}_{kind}.jsonl", "batch_output", data)
                setattr(batch, f"{kind}_file_id", stored.id)
        batch.enter("cancelled" if batch.cancelled.is_set() else
                    "expired" if time.time() >= batch.expires_at else "completed")

    async def _line(self, batch: Batch, request: dict[str, Any], scope, headers) -> dict[str, Any]:
        """One line's output: the app's answer (429 and 503 retried after their Retry-After), or why
        it did not run."""
        line_id, body = _new_id("batch_req"), {**request["body"], "stream": False}
        if self.priority is not None and batch.endpoint in PRIORITY_ENDPOINTS:
            body.setdefault("priority", self.priority)
        async with self.slots.line():
            while True:
                if batch.cancelled.is_set() or time.time() >= batch.expires_at:
                    result = {"id": line_id, "custom_id": request["custom_id"], "response": None,
                              "error": {"code": "batch_cancelled" if batch.cancelled.is_set() else "batch_expired",
                                        "message": "the batch ended before this request ran"}}
                    break
                status, answer_headers, answer = await self._post(batch, scope, headers, body)
                if batch.cancelled.is_set():  # it was aborted: what the app answered then is not its answer
                    continue
                if status in (429, 503):
                    retry_after = answer_headers.get(b"retry-after", b"1").decode()
                    await _sleep_or_cancel(batch, float(retry_after) if retry_after.isdigit() else 1.0)
                    continue
                result = {"id": line_id, "custom_id": request["custom_id"],
                          "response": {"status_code": status, "request_id": line_id, "body": answer}, "error": None}
                break
        outcome = "answered" if _succeeded(result) else "failed" if result["response"] else "not_run"
        if outcome == "answered":
            batch.completed += 1
        else:
            batch.failed += 1
        self.lines_done.labels(outcome).inc()
        return result

    async def _post(self, batch: Batch, scope, headers, body: dict[str, Any]) -> tuple[int, dict, Any]:
        """(status, headers, JSON body) of POSTing `body` to the batch's endpoint through the app; a
        cancelled batch disconnects, which aborts the request in the engine."""
        data = json.dumps(body).encode()
        path = batch.endpoint
        inner = {**scope, "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": headers + [(b"content-type", b"application/json"),
                                       (b"content-length", str(len(data)).encode())]}
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def disconnect_once_cancelled():
            await batch.cancelled.wait()
            return {"type": "http.disconnect"}

        async def collect(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.app(inner, replay(data, disconnect_once_cancelled), collect)
            answer = json.loads(b"".join(chunks) or b"null")
        except Exception as error:  # noqa: BLE001 - one line's failure is that line's error, not the batch's
            return 500, {}, {"error": {"message": f"{type(error).__name__}: {error}", "type": "api_error"}}
        return start.get("status", 500), dict(start.get("headers", [])), answer


def _limited(receive, max_bytes: int, error: APIError):
    """`receive` that raises `error` once the body passes max_bytes."""
    received = 0

    async def counted():
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > max_bytes:
            raise error
        return message

    return counted


def _succeeded(result: dict[str, Any]) -> bool:
    return result["response"] is not None and result["response"]["status_code"] < 300


async def _sleep_or_cancel(batch: Batch, seconds: float) -> None:
    try:
        await asyncio.wait_for(batch.cancelled.wait(), timeout=seconds)
    except TimeoutError:
        pass


def _page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """A cursor page as OpenAI's lists give it: `after` an id, at most `limit` (1-100) items."""
    try:
        limit = min(max(int(query.get("limit", 20)), 1), 100)
    except ValueError:
        raise APIError(400, "limit must be an integer", param="limit") from None
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


async def _send_file(send, path: Path) -> None:
    size = os.path.getsize(path)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]})
    with path.open("rb") as handle:
        while True:
            chunk = await asyncio.to_thread(handle.read, CHUNK_BYTES)
            more = handle.tell() < size
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
            if not more:
                break

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
the batch's window ends.

Files, batches and each line's result are kept on disk (`files_dir`, common/file_store.py), so a
server restarted on the same directory lists them all and goes on with the batches that were
running: the lines that had finished are not sent again. Lines run with their batch creator's key
as the security middleware reads it from the scope (`KEY_DIGEST`, set in process, never by a
client), so a batch needs no secret kept to go on after a restart.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.requests import Request

from hyperserve.common.asgi import limited_receive, replay, send_file, send_json
from hyperserve.common.chat_translation import read_json
from hyperserve.common.errors import APIError
from hyperserve.common.file_store import FileStore, StoredFile, new_id, write_atomically
from hyperserve.common.line_slots import LineSlots
from hyperserve.security.middleware import KEY_DIGEST

FILES, BATCHES = "/v1/files", "/v1/batches"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PRIORITY_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # those whose body takes `priority`
BATCH_PRIORITY = 100  # lower runs first; interactive requests default to 0
WINDOW_S = 24 * 3600  # completion_window "24h", the only one OpenAI offers
MAX_LINES = 50_000  # per batch, as OpenAI's
MAX_ACTIVE_BATCHES = 64  # running at once on a server, all owners together
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
MAX_FILE_BYTES = 200 * 2**20
MAX_CREATE_BYTES = 64 * 1024  # a batch's own request (the file id, the endpoint, metadata)


@dataclass
class Batch:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    metadata: dict[str, str] | None
    # -> in_progress -> finalizing -> completed | failed | cancelling -> cancelled | expired
    status: str = "validating"
    errors: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict[str, int] = field(default_factory=lambda: {"created_at": int(time.time())})
    key_digest: str | None = None  # the SHA-256 of its creator's API key, with which its lines run
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self) -> bytes:
        """What is kept on disk of it (all but the event a cancel sets, which its status says)."""
        kept = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cancelled"}
        return json.dumps(kept).encode()

    def enter(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    @property
    def expires_at(self) -> int:
        return self.times["created_at"] + WINDOW_S

    def card(self) -> dict[str, Any]:
        stamps = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                  "cancelling_at", "cancelled_at")
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint,
                "input_file_id": self.input_file_id, "completion_window": "24h", "status": self.status,
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


class BatchAPI:
    """/v1/files and /v1/batches in front of `app`. `governor`: the app's API keys, which own files
    and batches; `concurrency` and `busy_concurrency`: how many lines of all batches are in the app at
    once while it serves nothing else, and while it does (LineSlots); `priority`: the
    one their bodies get where they set none (None: none, for backends that take no `priority`);
    `registry`: where the batch metrics go."""

    def __init__(self, app, governor=None, files_dir: Path | None = None,
                 max_file_bytes: int = MAX_FILE_BYTES, max_stored_bytes: int = 4 * 2**30,
                 concurrency: int = 16, busy_concurrency: int = 2,
                 priority: int | None = BATCH_PRIORITY, registry: CollectorRegistry | None = None) -> None:
        self.app, self.governor, self.priority = app, governor, priority
        self.lines_done = Counter("hyperserve:batch_requests",
                                  "Batch lines ended, by outcome: answered (2xx), failed (any other status), "
                                  "not_run (the batch was cancelled or expired)", ["outcome"],
                                  registry=registry)
        Gauge("hyperserve:batches_running", "Batches validating, in progress, finalizing or cancelling",
              registry=registry).set_function(lambda: sum(b.status in ACTIVE for b in self.batches.values()))
        self.max_file_bytes = max_file_bytes
        self.store = FileStore(files_dir, max_stored_bytes)
        self.directory = self.store.directory / "batches"
        self.directory.mkdir(exist_ok=True)
        self.batches: dict[str, Batch] = {}
        for record in self.directory.glob("batch_*.json"):  # those kept by an earlier run
            batch = Batch(**json.loads(record.read_text()))
            self.batches[batch.id] = batch
        self.batches = dict(sorted(self.batches.items(), key=lambda item: item[1].times["created_at"]))
        self.slots = LineSlots(concurrency, min(busy_concurrency, concurrency))
        self._tasks: set[asyncio.Task] = set()
        # what a request's scope holds from the ASGI server and the app around this middleware (the
        # Starlette app, its lifespan state), for lines, which start here; taken from the scopes that pass
        self._context: dict[str, Any] = {}

    async def __call__(self, scope, receive, send) -> None:
        self._context.update((key, scope[key]) for key in ("app", "state") if key in scope)
        path = scope.get("path", "")
        kind = FILES if path == FILES or path.startswith(FILES + "/") else \
            BATCHES if path == BATCHES or path.startswith(BATCHES + "/") else None
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, self._lifespan_send(send))
        if scope["type"] != "http" or kind is None:
            if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
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
            return await self._batches(scope, receive, send, owner, name, tail, query, key)
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
            return await send_file(send, self.store.path(self.store.get(owner, file_id).id))
        raise APIError(404 if method == "GET" or file_id else 405, f"no route {method} {scope['path']}")

    async def _upload(self, scope, receive, owner: str) -> StoredFile:
        """A multipart upload (`file`, `purpose`), refused past max_file_bytes as it arrives."""
        too_large = APIError(413, f"files take at most {self.max_file_bytes} bytes", code="file_too_large")
        try:  # the form's own fields come besides the file
            bounded = limited_receive(receive, self.max_file_bytes + 64 * 1024, too_large)
            form = await Request(scope, bounded).form(max_files=1, max_fields=8)
        except APIError:
            raise
        except Exception as error:  # noqa: BLE001 - a malformed body from the client: say why
            raise APIError(400, f"expected a multipart form with 'file' and 'purpose': {error}") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise APIError(400, "purpose must be 'batch': this server keeps files for the Batch API",
                           param="purpose")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "the form holds no file", param="file")
        data = await upload.read()
        await form.close()
        if len(data) > self.max_file_bytes:
            raise too_large
        return self.store.add(owner, upload.filename or "upload.jsonl", purpose, data)

    # ---- batches -------------------------------------------------------------------------------

    def _lifespan_send(self, send):
        """The lifespan's `send`: once the app has started, the batches an earlier run left running
        go on; once it has shut down, a temporary store's directory goes."""
        async def forward(message) -> None:
            if message["type"] == "lifespan.startup.complete":
                for batch in self.batches.values():
                    if batch.status in ACTIVE:
                        if batch.status == "cancelling":
                            batch.cancelled.set()
                        self._start(batch)
            elif message["type"] == "lifespan.shutdown.complete":
                self.store.close()
            await send(message)

        return forward

    async def _batches(self, scope, receive, send, owner: str, batch_id: str, tail: str, query: dict,
                       key=None) -> None:
        method = scope["method"]
        if not batch_id and method == "POST":
            return await send_json(send, 200, (await self._create(receive, owner, key)).card())
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
                self._enter(batch, "cancelling")
                batch.cancelled.set()
            return await send_json(send, 200, batch.card())
        raise APIError(404 if method == "GET" else 405, f"no route {method} {scope['path']}")

    async def _create(self, receive, owner: str, key) -> Batch:
        too_large = APIError(413, "the request body is too large")
        body = await read_json(limited_receive(receive, MAX_CREATE_BYTES, too_large))
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
            raise APIError(400, "the input file must have been uploaded with purpose 'batch'",
                           param="input_file_id")
        if sum(b.status in ACTIVE for b in self.batches.values()) >= MAX_ACTIVE_BATCHES:
            raise APIError(429, f"{MAX_ACTIVE_BATCHES} batches are running; retry once one has finished",
                           type_="rate_limit_error", headers={"Retry-After": "60"})
        batch = Batch(new_id("batch"), owner, endpoint, source.id, metadata,
                      key_digest=key.sha256 if key is not None else None)
        self.batches[batch.id] = batch
        self._save(batch)
        self._start(batch)
        return batch

    def _start(self, batch: Batch) -> None:
        """Run the batch in the background, in a context of its own: not the creating request's,
        whose context variables would pass to every line. Ray Serve's handles take their request's
        internal id from there, and its router keeps one pending request per id: lines behind the
        Ray ingress stalled."""
        task = asyncio.create_task(self._run(batch), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _enter(self, batch: Batch, status: str) -> None:
        batch.enter(status)
        self._save(batch)

    def _save(self, batch: Batch) -> None:
        write_atomically(self.directory / f"{batch.id}.json", batch.record())

    async def _run(self, batch: Batch) -> None:
        """Validate the input, run its lines, write the output and error files; anything that stops
        that (the input deleted meanwhile, the store full) fails the batch, saying why."""
        try:
            source = self.store.get(batch.owner, batch.input_file_id, param="input_file_id")
            await self._process(batch, source)
        except Exception as error:  # noqa: BLE001 - the batch's own failure, reported on it
            message = error.message if isinstance(error, APIError) else f"{type(error).__name__}: {error}"
            batch.errors = [{"code": "batch_failed", "message": message, "param": None, "line": None}]
            self._enter(batch, "failed")

    async def _process(self, batch: Batch, source: StoredFile) -> None:
        data = await asyncio.to_thread(self.store.path(source.id).read_bytes)
        requests, errors = read_lines(data, batch.endpoint)
        if errors:
            batch.errors = errors[:100]
            return self._enter(batch, "failed")
        batch.total = len(requests)
        done = self._results(batch)  # lines an earlier run finished
        batch.completed = sum(_succeeded(result) for result in done.values())
        batch.failed = len(done) - batch.completed
        if batch.status == "validating":
            self._enter(batch, "in_progress")
        with (self.directory / f"{batch.id}.results.jsonl").open("a") as log:
            async def run(index: int, request: dict[str, Any]) -> dict[str, Any]:
                if index in done:
                    return done[index]
                result = await self._line(batch, request)
                log.write(json.dumps({"index": index, "result": result}) + "\n")
                log.flush()  # kept, should the process end before the batch
                return result

            results = await asyncio.gather(*(run(i, request) for i, request in enumerate(requests)))
        if not batch.cancelled.is_set():
            self._enter(batch, "finalizing")
        files: dict[str, list[dict[str, Any]]] = {"output": [], "error": []}
        for result in results:
            files["output" if _succeeded(result) else "error"].append(result)
        for kind, lines in files.items():
            if lines:
                data = "".join(json.dumps(line) + "\n" for line in lines).encode()
                stored = self.store.add(batch.owner, f"{batch.id}_{kind}.jsonl", "batch_output", data)
                setattr(batch, f"{kind}_file_id", stored.id)
        self._enter(batch, "cancelled" if batch.cancelled.is_set() else
                    "expired" if time.time() >= batch.expires_at else "completed")

    def _results(self, batch: Batch) -> dict[int, dict[str, Any]]:
        """The results of its lines kept by an earlier run, by line (a last line cut short is not one)."""
        path = self.directory / f"{batch.id}.results.jsonl"
        results = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                entry = json.loads(line)
                results[entry["index"]] = entry["result"]
            except (ValueError, KeyError, TypeError):
                continue
        return results

    async def _line(self, batch: Batch, request: dict[str, Any]) -> dict[str, Any]:
        """One line's output: the app's answer (429 and 503 retried after their Retry-After), or why
        it did not run."""
        line_id, body = new_id("batch_req"), {**request["body"], "stream": False}
        if self.priority is not None and batch.endpoint in PRIORITY_ENDPOINTS:
            body.setdefault("priority", self.priority)
        async with self.slots.line():
            while True:
                if batch.cancelled.is_set() or time.time() >= batch.expires_at:
                    code = "batch_cancelled" if batch.cancelled.is_set() else "batch_expired"
                    result = {"id": line_id, "custom_id": request["custom_id"], "response": None,
                              "error": {"code": code, "message": "the batch ended before this request ran"}}
                    break
                status, answer_headers, answer = await self._post(batch, body)
                if batch.cancelled.is_set():  # it was aborted: what the app answered then is not its answer
                    continue
                if status in (429, 503):
                    retry_after = answer_headers.get(b"retry-after", b"1").decode()
                    await _sleep_or_cancel(batch, float(retry_after) if retry_after.isdigit() else 1.0)
                    continue
                response = {"status_code": status, "request_id": line_id, "body": answer}
                result = {"id": line_id, "custom_id": request["custom_id"], "response": response,
                          "error": None}
                break
        outcome = "answered" if _succeeded(result) else "failed" if result["response"] else "not_run"
        if outcome == "answered":
            batch.completed += 1
        else:
            batch.failed += 1
        self.lines_done.labels(outcome).inc()
        return result

    async def _post(self, batch: Batch, body: dict[str, Any]) -> tuple[int, dict, Any]:
        """(status, headers, JSON body) of POSTing `body` to the batch's endpoint through the app,
        with the batch creator's key; a cancelled batch disconnects, which aborts the request in
        the engine."""
        data = json.dumps(body).encode()
        path = batch.endpoint
        inner = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": b"", "client": None, "server": None,
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(data)).encode())]}
        inner.update(self._context)
        if "state" in inner:
            inner["state"] = dict(inner["state"])  # a copy per request, as ASGI servers give it
        if batch.key_digest is not None:
            inner[KEY_DIGEST] = batch.key_digest
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

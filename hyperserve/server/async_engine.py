"""AsyncEngine: the LLMEngine step loop on its own thread, streamed to asyncio tasks.

The event loop never waits on a forward pass and the engine never waits on a client: handlers
put commands (add, abort) on a thread-safe queue that the engine thread drains between steps,
and each step's outputs are handed back to the event loop with `call_soon_threadsafe`, into one
asyncio.Queue per request. A slow client only lets its own queue grow.

The engine is built on that thread too, so every PyTorch operation of the process runs on one
thread. GNU OpenMP keeps a pool of worker threads per thread that starts parallel work, and once
the pools hold more threads than there are cores it stops spin-waiting between operations: a
model loaded on one thread and run on another decoded at half speed (34 against 16 ms a token
for SmolLM2 int4 on 2 cores).

Every stream ends: with its last output, with RequestFailedError when the engine failed while
running that request (the others go on), or with EngineDeadError for all of them at once when
the engine thread cannot go on; after that, `submit` refuses at once and `on_dead` is called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hyperserve.engine.engine import EngineDeadError, LLMEngine
from hyperserve.layers.lora import LoRARequest
from hyperserve.outputs import RequestOutput
from hyperserve.sampling_params import SamplingParams

logger = logging.getLogger("hyperserve.async_engine")


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; other requests were not affected."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    pin_ttl_s: float | None = None  # a prefix to pin rather than a completion
    lora_request: LoRARequest | None = None
    final_only: bool = False  # its stream gets the finished output alone
    cache_salt: str = ""  # its tenant (LLMEngine.add_request)


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Unpin:
    pin_id: str


@dataclass(slots=True)
class _Call:
    function: Callable[[LLMEngine], object]
    result: concurrent.futures.Future


class AsyncEngine:
    def __init__(self, load_engine: Callable[[], LLMEngine],
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 on_dead: Callable[[BaseException], None] | None = None):
        """Builds the engine with `load_engine` on the engine thread; `ready` resolves to it."""
        self._load_engine = load_engine
        self.engine: LLMEngine | None = None
        self.ready: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        self.on_dead = on_dead  # called on the engine thread once, when it stops for good
        self.dead: str | None = None  # why the engine stopped; None while it runs
        self._commands: queue.Queue[_Add | _Abort | _Unpin | _Call | None] = queue.Queue()
        # Both threads touch these: the event loop registers streams and counts adds, the
        # engine thread delivers, unregisters and uncounts.
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending = 0  # adds queued but not yet in the engine
        self._thread = threading.Thread(target=self._run, name="hyperserve-engine", daemon=True)
        self._stopped = False
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending

    def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
        pin_ttl_s: float | None = None, lora_request: LoRARequest | None = None, final_only: bool = False,
        cache_salt: str = "",
    ) -> RequestStream:
        """Queue a request now (so admission control counts it at once); stream it from the result.
        With `pin_ttl_s`, the request pins its prompt's KV instead (see LLMEngine.pin_prefix).
        With `final_only`, the stream gets only the finished output: a response that is not
        streamed then wakes the event loop once, not every token (on a 2-core machine that CPU
        comes out of the engine's steps)."""
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            if self._stopped:
                raise RuntimeError("the engine is shutting down")
            self._streams[request_id] = (asyncio.get_running_loop(), outputs)
            self._pending += 1
        self._commands.put(_Add(request_id, prompt_ids, params, priority, time.time(), pin_ttl_s,
                                lora_request, final_only, cache_salt))
        return RequestStream(self, request_id, outputs)

    async def call(self, function: Callable[[LLMEngine], object]) -> object:
        """function(engine) on the engine thread, between steps and in order with the requests
        queued before and after it (moving KV blocks in or out); its result or its exception."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            if self._stopped:
                raise RuntimeError("the engine is shutting down")
            self._commands.put(_Call(function, result))
        return await asyncio.wrap_future(result)

    def unpin(self, pin_id: str) -> bool:
        """Release a pinned prefix (on the engine thread); False if there is no such pin."""
        if pin_id not in self.engine.kv_cache.pins:
            return False
        self._commands.put(_Unpin(pin_id))
        return True

    def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self.engine = self._load_engine()
        except BaseException as error:
            self.ready.set_exception(error)
            return
        self.ready.set_result(self.engine)
        try:
            self._loop()
        except BaseException as error:  # nothing may end this thread silently
            self._die(error)
        finally:
            self._fail_pending_calls()
            self.engine.close()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished_requests()
            # idle, it still wakes when a pin expires, so that its blocks go back to the pool (and
            # the KV use the metrics report falls) without waiting for the next request
            expiry = engine.kv_cache.next_pin_expiry() if block else None
            timeout = None if expiry is None else max(0.0, expiry - time.time()) + 0.01
            try:
                while True:
                    command = self._commands.get(block=block, timeout=timeout)
                    if command is None:
                        return
                    self._apply(command)
                    block = False
            except queue.Empty:
                pass
            self._emit(engine.step())

    def _emit(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine, outputs)
            except Exception:  # metrics must never cost a request its answer
                logger.exception("the step hook failed")
        self._deliver([(output.request_id, RequestFailedError(output.error) if output.error else output)
                       for output in outputs])

    def _apply(self, command: _Add | _Abort | _Unpin | _Call) -> None:
        if isinstance(command, _Abort):
            output = self.engine.abort_request(command.request_id)
            if output is not None:
                self._emit([output])  # the stream is gone already; this settles metrics
            return
        if isinstance(command, _Unpin):
            self.engine.unpin_prefix(command.pin_id)
            return
        if isinstance(command, _Call):
            try:
                command.result.set_result(command.function(self.engine))
            except Exception as error:  # the caller's to handle; the engine goes on
                command.result.set_exception(error)
            return
        with self._lock:
            self._pending -= 1
            if command.request_id not in self._streams:
                return  # the client left before the engine saw the request
        try:
            if command.pin_ttl_s is not None:
                self.engine.pin_prefix(command.request_id, command.prompt_ids, command.pin_ttl_s,
                                       command.cache_salt)
            else:
                self.engine.add_request(command.request_id, command.prompt_ids, command.params,
                                        command.priority, command.arrival_time, command.lora_request,
                                        command.final_only, command.cache_salt)
        except Exception as error:  # ValueError: the client's mistake; anything else fails this request only
            if not isinstance(error, ValueError):
                logger.exception("adding request %s failed", command.request_id)
                error = RequestFailedError(f"{type(error).__name__}: {error}")
            self._deliver([(command.request_id, error)])

    def _deliver(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        """Put each item in its request's queue: one wake-up of each event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | Exception]]] = {}
        with self._lock:
            for request_id, item in items:
                last = isinstance(item, Exception) or item.finished
                # The last item unregisters the stream here, so a stream nobody reads cannot leak.
                target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, queued in by_loop.items():
            _hand_over(loop, queued)

    def _die(self, error: BaseException) -> None:
        """The engine thread is ending for good: every stream gets EngineDeadError, now and later."""
        logger.critical("the engine stopped: %s: %s", type(error).__name__, error, exc_info=error)
        with self._lock:
            self.dead = f"{type(error).__name__}: {error}"
            streams, self._streams = list(self._streams.values()), {}
        for loop, outputs in streams:
            _hand_over(loop, [(outputs, EngineDeadError(self.dead))])
        if self.on_dead is not None:
            self.on_dead(error)

    def _fail_pending_calls(self) -> None:
        """Calls still queued when the thread ends get an error rather than no answer."""
        with self._lock:
            self._stopped = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call):
                command.result.set_exception(EngineDeadError(self.dead or "the engine has stopped"))

    def _close(self, request_id: str) -> None:
        with self._lock:
            registered = self._streams.pop(request_id, None) is not None
        if registered:
            self._commands.put(_Abort(request_id))


def _hand_over(loop: asyncio.AbstractEventLoop, queued: list[tuple[asyncio.Queue, object]]) -> None:
    def put_all() -> None:
        for outputs, item in queued:
            outputs.put_nowait(item)

    with contextlib.suppress(RuntimeError):  # a loop already closed has nobody to tell
        loop.call_soon_threadsafe(put_all)


class RequestStream:
    """Outputs of one submitted request, in order; `close()` before the end aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue) -> None:
        self._engine, self.request_id, self._outputs = engine, request_id, outputs
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, Exception):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine._close(self.request_id)

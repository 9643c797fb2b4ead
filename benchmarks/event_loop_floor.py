"""What streaming one token costs the server's event loop, against what it costs with no engine at all.

The server's event loop spends CPU on every streamed token (waking up for the engine thread's
hand-over, SSE framing, the socket write). On a 2-core machine whose cores both decode, that CPU
comes out of a step. This measures the event-loop thread's CPU time per streamed chunk (from
/proc, the same httpx client reading every stream) for:
- `raw ASGI`: a bare ASGI app under uvicorn (uvloop, httptools) whose chunks come from a thread
  through `call_soon_threadsafe` every 6 ms, as the engine's do: the floor of the HTTP stack;
- `FastAPI StreamingResponse`: the same through FastAPI's routing and Starlette's StreamingResponse,
  as `hyperserve serve` streams;
- `hyperserve serve`: the real server decoding SmolLM2 (128 tokens a request).

    python benchmarks/event_loop_floor.py [--requests 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import start_server  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

CHUNKS = 128
INTERVAL_S = 0.006
CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}]}


def _produce(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    """A stand-in engine thread: one chunk every INTERVAL_S, then None."""
    def run() -> None:
        for i in range(CHUNKS):
            time.sleep(INTERVAL_S)
            loop.call_soon_threadsafe(queue.put_nowait, i)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=run, daemon=True).start()


async def _events():
    queue: asyncio.Queue = asyncio.Queue()
    _produce(asyncio.get_running_loop(), queue)
    while await queue.get() is not None:
        yield f"data: {json.dumps(CHUNK)}\n\n"
    yield "data: [DONE]\n\n"


async def raw_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    async for event in _events():
        await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def fastapi_app():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        return StreamingResponse(_events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


def _thread_cpu_s(pid: int) -> float:
    """CPU time of a process's main thread (where uvicorn runs the event loop)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stream_all(port: int, requests: int, body: dict) -> int:
    chunks = 0
    with httpx.Client(timeout=120) as client:
        for _ in range(requests):
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                response.raise_for_status()
                chunks += sum(1 for line in response.iter_lines() if line.startswith("data:"))
    return chunks


def measure(process: subprocess.Popen, port: int, requests: int, body: dict) -> float:
    """Event-loop CPU ms per streamed chunk, after one warm-up request."""
    _stream_all(port, 1, body)
    before = _thread_cpu_s(process.pid)
    chunks = _stream_all(port, requests, body)
    return 1000 * (_thread_cpu_s(process.pid) - before) / chunks


def _uvicorn(target: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "uvicorn", target, "--port", str(port), "--loop", "uvloop", "--http",
               "httptools", "--log-level", "warning"] + (["--factory"] if target.endswith("fastapi_app") else [])
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/health")
            return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"uvicorn {target} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for name, target in (("raw ASGI", "benchmarks.event_loop_floor:raw_app"),
                         ("FastAPI StreamingResponse", "benchmarks.event_loop_floor:fastapi_app")):
        port = free_port()
        process = _uvicorn(target, port)
        try:
            rows.append((name, measure(process, port, args.requests, {})))
        finally:
            process.terminate()
            process.wait(timeout=30)
    port = free_port()
    server = start_server(port, [])
    try:
        body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": CHUNKS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        rows.append(("hyperserve serve (SmolLM2 decoding)", measure(server, port, args.requests, body)))
    finally:
        server.terminate()
        server.wait(timeout=60)
    flags = cpu_flags()
    print(f"\nCPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
          f"{os.cpu_count()} cores; {args.requests} streams of {CHUNKS} chunks each")
    print("\n| server | event-loop CPU ms per streamed chunk |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()

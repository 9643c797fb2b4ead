"""A minimal OpenAI-compatible backend for gateway tests and benchmarks: it answers instantly with
"<name> says: <last user message>", one token per word, each with a controllable log-probability
(and embeds each input as [its length, the length of <name>]).
POST /control changes its behaviour (fail with a status, delay, per-token delay of streams, logprob);
GET /stats counts requests, and the streams still open (a client that went away closes its own).

    python tests/gateway/stub_backend.py --port 9001 --name a
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def build_stub(name: str) -> Starlette:
    state = {"fail_status": None, "delay_s": 0.0, "token_delay_s": 0.0, "logprob": -0.1, "count": 0,
             "open_streams": 0}

    def answer_text(body: dict, chat: bool) -> str:
        if chat:
            content = body["messages"][-1].get("content")
        else:
            content = body["prompt"]
        return f"{name} says: {content}"

    async def complete(request: Request) -> JSONResponse | StreamingResponse:
        chat = request.url.path.endswith("chat/completions")
        body = await request.json()
        state["count"] += 1
        state["cache_salt"] = body.get("cache_salt")  # what the gateway sent of the tenant
        if state["delay_s"]:
            await asyncio.sleep(state["delay_s"])
        if state["fail_status"]:
            return JSONResponse({"error": {"message": "stub failure", "type": "server_error"}},
                                status_code=state["fail_status"])
        words = answer_text(body, chat).split(" ")
        tokens = [w if i == 0 else " " + w for i, w in enumerate(words)]
        lp = state["logprob"]
        logprobs = None
        if body.get("logprobs") not in (None, False):
            logprobs = ({"content": [{"token": t, "logprob": lp, "bytes": [], "top_logprobs": []} for t in tokens]}
                        if chat else {"tokens": tokens, "token_logprobs": [lp] * len(tokens),
                                      "top_logprobs": [{}] * len(tokens), "text_offset": [0] * len(tokens)})
        usage = {"prompt_tokens": 10, "completion_tokens": len(tokens), "total_tokens": 10 + len(tokens),
                 "prompt_tokens_details": {"cached_tokens": 4}}
        base = {"id": f"stub-{state['count']}", "created": int(time.time()), "model": name}
        if body.get("stream"):
            async def events():
                state["open_streams"] += 1
                try:
                    for i, token in enumerate(tokens):
                        last = i == len(tokens) - 1
                        choice = {"index": 0, "logprobs": None, "finish_reason": "stop" if last else None}
                        choice.update({"delta": {"content": token}} if chat else {"text": token})
                        chunk = {**base, "object": "chat.completion.chunk" if chat else "text_completion",
                                 "choices": [choice]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        await asyncio.sleep(state["token_delay_s"])
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    state["open_streams"] -= 1
            return StreamingResponse(events(), media_type="text/event-stream")
        text = "".join(tokens)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
        return JSONResponse({**base, "object": "chat.completion" if chat else "text_completion",
                             "choices": [{**choice, "logprobs": logprobs, "finish_reason": "stop"}], "usage": usage})

    async def rerank(request: Request) -> JSONResponse:
        """Documents by length, longest first, with the stub's name as the model."""
        body = await request.json()
        state["count"] += 1
        texts = [d if isinstance(d, str) else d["text"] for d in body["documents"]]
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        results = [{"index": i, "relevance_score": float(len(texts[i]))} for i in order]
        return JSONResponse({"model": name, "results": results})

    async def embed(request: Request) -> JSONResponse:
        """A vector per input: [its length in characters, the stub's number], so a test sees which backend answered."""
        body = await request.json()
        state["count"] += 1
        if state["fail_status"]:
            return JSONResponse({"error": {"message": "stub failure", "type": "server_error"}},
                                status_code=state["fail_status"])
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        data = [{"object": "embedding", "index": i, "embedding": [float(len(text)), float(len(name))]}
                for i, text in enumerate(texts)]
        tokens = sum(len(text.split()) for text in texts)
        return JSONResponse({"object": "list", "data": data, "model": body.get("model"),
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def control(request: Request) -> JSONResponse:
        state.update(await request.json())
        return JSONResponse(state)

    async def stats(_: Request) -> JSONResponse:
        return JSONResponse(state)

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[
        Route("/v1/chat/completions", complete, methods=["POST"]), Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/embeddings", embed, methods=["POST"]), Route("/v1/rerank", rerank, methods=["POST"]),
        Route("/control", control, methods=["POST"]),
        Route("/stats", stats), Route("/health", health),
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="stub")
    args = parser.parse_args()
    uvicorn.run(build_stub(args.name), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)

"""`hyperserve run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through the server
in this process, with no port opened (as vLLM's `run-batch`).

The file goes through the server's own Batch API (common/batch_api.py) over an in-process transport,
so each line gets what it would get from `hyperserve serve`, and the results are OpenAI's batch
output lines, answers and errors together, in the input's order.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from asgi_lifespan import LifespanManager
from tqdm import tqdm

from hyperserve.common.batch_api import ENDPOINTS

POLL_S = 0.2


def batch_endpoint(data: bytes) -> str:
    """The endpoint a batch file's lines name (one for all: a batch has one); ValueError otherwise."""
    urls = set()
    for line in data.decode(errors="replace").splitlines():
        if line.strip():
            try:
                urls.add(json.loads(line).get("url"))
            except (ValueError, AttributeError, RecursionError):
                continue  # the Batch API says which lines are malformed
    if len(urls) != 1 or next(iter(urls)) not in ENDPOINTS:
        raise ValueError(f"every line's url must be the same one of {', '.join(ENDPOINTS)}; the file has "
                         f"{sorted(map(str, urls)) or 'none'}")
    return urls.pop()


async def run_batch(app, input_path: Path, output_path: Path, progress: bool = True) -> dict[str, int]:
    """Run the batch file at input_path through `app` (started here); write the results to
    output_path and return the batch's request counts. RuntimeError if the batch fails as a whole."""
    data = input_path.read_bytes()
    endpoint = batch_endpoint(data)
    async with LifespanManager(app, startup_timeout=None, shutdown_timeout=None), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://run-batch", timeout=None) as client:
        while (health := await client.get("/health")).status_code != 200:
            status = health.json().get("status", "")
            if status not in ("loading", ""):
                raise RuntimeError(f"the server did not start: {status}")
            await asyncio.sleep(POLL_S)
        upload = await client.post("/v1/files", files={"file": (input_path.name, data)}, data={"purpose": "batch"})
        _check(upload)
        batch = await client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": endpoint,
                                                        "completion_window": "24h"})
        _check(batch)
        with tqdm(desc="requests", unit="req", disable=not progress) as bar:
            while True:
                state = (await client.get(f"/v1/batches/{batch.json()['id']}")).json()
                counts = state["request_counts"]
                bar.total = counts["total"] or None
                bar.update(counts["completed"] + counts["failed"] - bar.n)
                if state["status"] in ("completed", "failed", "cancelled", "expired"):
                    break
                await asyncio.sleep(POLL_S)
        if state["status"] == "failed":
            problems = "; ".join(f"line {e['line']}: {e['message']}" if e["line"] else e["message"]
                                 for e in state["errors"]["data"])
            raise RuntimeError(f"the batch file is not valid: {problems}")
        results = []
        for file_id in (state["output_file_id"], state["error_file_id"]):
            if file_id is not None:
                content = await client.get(f"/v1/files/{file_id}/content")
                results += [json.loads(line) for line in content.text.splitlines()]
    order = {json.loads(line)["custom_id"]: i for i, line in enumerate(data.decode().splitlines()) if line.strip()}
    results.sort(key=lambda result: order[result["custom_id"]])
    output_path.write_text("".join(json.dumps(result) + "\n" for result in results))
    return counts


def _check(response: httpx.Response) -> None:
    if response.status_code != 200:
        raise RuntimeError(response.json().get("error", {}).get("message", response.text))

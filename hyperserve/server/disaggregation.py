"""Disaggregated prefill: long prompts computed by a prefill server, decoded here.

A long prompt's prefill takes many steps' worth of compute, and every stream decoding beside it
waits through the steps it shares (chunked prefill bounds each wait, not their sum). With
`hyperserve serve --role decode --prefill-url URL`, a prompt with at least `--disagg-min-tokens`
tokens that this server's prefix cache lacks is first sent to a `--role prefill` server, whose
POST /v1/kv/prefill computes it (as a pinned prefix, so nothing evicts it meanwhile) and answers
with its KV blocks and their prefix-cache hashes. They go into this server's prefix cache, and
the request then finds its prompt cached: it computes only its last partial block here.

The prefix cache works on both sides: the decode server asks only for the blocks it lacks
(`skip_blocks`), and the prefill server reuses prefixes it has computed before. Both must run
the same model with the same KV layout (`kv_identity`: weights, dtypes, quantization, block size).
Any failure (the prefill server down, slow, overloaded, or another model) costs nothing but
time: the prompt is computed here as it would have been.

Transport: one HTTP request (httpx), the blocks as safetensors. It needs no process group, so
decode and prefill servers start, fail and scale independently, on one host or several, behind
the same API keys; the body is one contiguous copy of the blocks. Where bandwidth matters (GPUs
across hosts), an RDMA transport (NIXL, Mooncake) would replace the body, not the protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import torch
from safetensors.torch import load, save

from hyperserve.server.async_engine import AsyncEngine

logger = logging.getLogger("hyperserve.disaggregation")

HASH_BYTES = 32  # SHA-256, the prefix cache's block hash


def encode_blocks(hashes: list[bytes], tensors: dict[str, torch.Tensor]) -> bytes:
    """Blocks (tensors [blocks, layers, block_size, ...]) and their hashes as one safetensors body."""
    table = torch.frombuffer(bytearray(b"".join(hashes)), dtype=torch.uint8).view(len(hashes), HASH_BYTES)
    return save({"hashes": table, **{name: t.contiguous() for name, t in tensors.items()}})


def decode_blocks(body: bytes) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    tensors = load(body)
    table = tensors.pop("hashes")
    return [bytes(row.tolist()) for row in table], tensors


class RemotePrefill:
    """The decode role's client of a prefill server."""

    def __init__(self, url: str, min_tokens: int, timeout_s: float, api_key: str | None = None) -> None:
        self.min_tokens = min_tokens
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers)

    async def prefill(self, engine: AsyncEngine, prompt: list[int], cache_salt: str = "") -> int:
        """Have the prefill server compute what the prefix cache lacks of this prompt (of the
        tenant `cache_salt`, whose blocks the prefill server keeps apart too), if that is at least
        min_tokens, and take its blocks; returns how many were taken. Never raises: a failure
        leaves the prompt to this engine."""
        if len(prompt) <= self.min_tokens:  # too short however little is cached: no hashing
            return 0
        llm = engine.engine
        hashes = llm.kv_transfer.prefix_hashes(prompt, cache_salt)
        # read from the event loop while the engine thread may change the pool: a stale answer
        # costs at most a transfer of blocks that were here, or a prefill that could have been
        have = llm.kv_cache.num_cached_blocks(hashes)
        if (len(hashes) - have) * llm.kv_cache.block_size < self.min_tokens:
            return 0
        started = time.perf_counter()
        try:
            response = await self.client.post("/v1/kv/prefill", json={
                "prompt_token_ids": prompt, "skip_blocks": have, "kv_identity": llm.kv_identity,
                "cache_salt": cache_salt})
            response.raise_for_status()
            received, tensors = await asyncio.to_thread(decode_blocks, response.content)  # off the event loop
            if received != hashes[have:]:
                raise ValueError("the prefill server sent blocks of another prompt or block size")
            inserted = await engine.call(lambda e: e.kv_transfer.import_prefix(received, tensors))
        except Exception as error:  # anything: the prompt is computed here
            llm.kv_transfer.stats.transfer_failures += 1
            logger.warning("remote prefill failed, computing the prompt here: %s: %s", type(error).__name__, error)
            return 0
        finally:
            llm.kv_transfer.stats.transfer_seconds += time.perf_counter() - started
        return inserted

    async def close(self) -> None:
        await self.client.aclose()

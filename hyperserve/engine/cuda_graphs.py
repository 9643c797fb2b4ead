"""CUDA graphs of the decode step: one per batch-size bucket, replayed over persistent inputs.

At decode batch sizes a step is hundreds of small kernels (about ten per layer) whose launches
from Python take longer than the GPU takes to read the weights. Capturing the whole step
(embedding -> layers -> logits) once per bucket turns it into one replay.

A graph reads fixed addresses, so its inputs live in persistent buffers sized for the largest
bucket. A step copies its sequences into the first rows and pads the rest of its bucket with rows
that attend to nothing (context length 0, which the Triton decode kernel answers with zeros) and
write their K/V into a padding slot no sequence owns. The decode kernel's split count depends only
on the batch shape, so a graph stays valid as contexts grow. Every graph writes its logits into
the same output buffer: one of its own per bucket would outlive its capture, and at 512 sequences
over a 128k vocabulary those buffers held 4.3 GB the KV pool's budget had not counted.

A batch runs in the fastest graph that holds it, which is not always the smallest: the GEMM
library picks its kernel by shape, and on an H200 cuBLAS took 273 us for Llama-3-8B's gate/up
projection at 448 rows but 163 us at 512 (benchmarks/gpu_kernels.py --gemm). After capture each
graph's replay is timed (every row padding: attention costs nothing, the time is the products'),
and a bucket that a larger one beats by more than ROUTE_MARGIN hands its batches to that one.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from hyperserve.layers.attention import AttentionMetadata, DecodeGroup, padded_block_tables

logger = logging.getLogger("hyperserve.cuda_graphs")

DecodeStep = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
ROUTE_MARGIN = 0.03  # a larger bucket takes a batch only if its replay is this much faster


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


def fastest_buckets(replay_seconds: dict[int, float], margin: float = ROUTE_MARGIN) -> dict[int, int]:
    """Where each bucket's batches run: in the fastest bucket at or above it when that one's replay
    is more than `margin` faster than its own, else in itself."""
    buckets = sorted(replay_seconds)
    route = {}
    for i, bucket in enumerate(buckets):
        best = min(buckets[i:], key=lambda b: (replay_seconds[b], b))
        route[bucket] = best if replay_seconds[best] < (1 - margin) * replay_seconds[bucket] else bucket
    return route


class DecodeGraphs:
    def __init__(self, step: DecodeStep, max_batch: int, max_blocks: int, block_size: int, padding_slot: int,
                 sliding_window: int | None, device: torch.device, use_cuda_graphs: bool = True) -> None:
        """`step` computes logits [B, V] from decode inputs; without use_cuda_graphs (the CPU, in
        tests) it runs eagerly over the same buffers and padding."""
        self.step = step
        self.buckets = batch_buckets(max_batch)
        self.block_size = block_size
        self.padding_slot = padding_slot
        self.sliding_window = sliding_window
        self.use_cuda_graphs = use_cuda_graphs
        rows = self.buckets[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), padding_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max_batch, V]: every graph's output
        self._tables: list[list[int]] = []  # the last run's block tables
        self.capture_seconds = 0.0
        self.route = {b: b for b in self.buckets}  # bucket -> the graph its batches replay
        self.replay_seconds: dict[int, float] = {}  # each graph's timed replay, where routed

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def capture(self, route: bool = True) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool; with
        `route`, time each graph and send batches to the fastest that holds them."""
        started, pool = time.perf_counter(), None
        for batch in reversed(self.buckets):
            logits = self._run_eager(batch)  # warm-up: Triton compiles, cuBLAS picks its kernels
            if self._logits is None:
                self._logits = logits.new_empty(self.max_batch, logits.shape[-1])
            del logits
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[:batch].copy_(self._run_eager(batch))
            pool = graph.pool()
            self._graphs[batch] = graph
        torch.cuda.synchronize()
        if route:
            self.replay_seconds = {batch: self._replay_seconds(batch) for batch in self.buckets}
            self.route = fastest_buckets(self.replay_seconds)
        self.capture_seconds = time.perf_counter() - started
        moved = {b: to for b, to in self.route.items() if to != b}
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s%s", len(self.buckets),
                    self.max_batch, self.capture_seconds, f"; run in larger graphs: {moved}" if moved else "")

    def _replay_seconds(self, batch: int, replays: int = 3) -> float:
        """One replay's time of a bucket's graph, its rows all padding (as after capture)."""
        self._graphs[batch].replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            self._graphs[batch].replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / replays

    def run(self, token_ids: list[int] | torch.Tensor, positions: list[int],
            block_tables: list[list[int]] | None) -> torch.Tensor:
        """Logits [B, V] of B decoding sequences: each one's new token (a device tensor: the tokens
        the previous step sampled), its position and block table (None: the previous run's tables,
        as in a multi-step decode's later steps)."""
        batch = len(positions)
        bucket = self.route[self.buckets[bisect.bisect_left(self.buckets, batch)]]
        if block_tables is not None:
            self._tables = block_tables
            width = max(len(t) for t in block_tables)
            self.block_tables[:batch, :width].copy_(padded_block_tables(block_tables, width, torch.int32),
                                                    non_blocking=True)
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, p in zip(self._tables, positions)]
        positions_t = torch.tensor(positions)
        if not isinstance(token_ids, torch.Tensor):
            token_ids = torch.tensor(token_ids)
        self.input_ids[:batch].copy_(token_ids, non_blocking=True)
        self.positions[:batch].copy_(positions_t, non_blocking=True)
        self.slot_mapping[:batch].copy_(torch.tensor(slots), non_blocking=True)
        self.context_lens[:batch].copy_(positions_t + 1, non_blocking=True)
        self.slot_mapping[batch:bucket].fill_(self.padding_slot)  # padding rows: no context, harmless writes
        self.context_lens[batch:bucket].zero_()
        if not self.use_cuda_graphs:
            return self._run_eager(bucket)[:batch]
        self._graphs[bucket].replay()
        return self._logits[:batch]

    def _run_eager(self, batch: int) -> torch.Tensor:
        group = DecodeGroup(None, self.block_tables[:batch], self.context_lens[:batch], None)
        attn = AttentionMetadata(self.slot_mapping[:batch], [group], [], self.sliding_window)
        return self.step(self.input_ids[:batch], self.positions[:batch], attn)

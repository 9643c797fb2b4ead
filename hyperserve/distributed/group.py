"""A tensor-parallel group: the ranks that each hold a slice of every layer, and what they share.

Megatron's split of a decoder layer: Q/K/V and gate/up are cut by output (each rank its own heads
and its own run of the MLP's width), o and down by input, so each rank's o and down give a partial
sum of the full output and one all-reduce per projection pair completes it. The embedding and the
LM head are cut by vocabulary: a rank embeds the ids in its range (zero elsewhere, summed by an
all-reduce) and computes its range of logits (gathered on every rank). K/V heads are split whole,
each with its query heads, so every rank's KV pool holds only its own heads; the split may be
uneven (SmolLM2's 3 K/V heads over 2 ranks: 2 and 1). With more ranks than K/V heads, each K/V
head is replicated on size / num_kv_heads ranks, which split its query heads (as vLLM does: Gemma 3
1B's one K/V head over 2 ranks, Qwen3-30B-A3B's 4 over 8).

Tensors travel over a torch.distributed process group made for the engine (gloo on the CPU, NCCL
on CUDA) rather than the global default group, so one process can hold several engines.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # a rank that stops answering fails the step after this
INT4_GROUP = 32  # the MLP's width is cut at multiples of this, so int4 groups stay whole on one rank


def split(n: int, parts: int, index: int, multiple: int = 1) -> tuple[int, int]:
    """[start, end) of part `index` when n items are cut into `parts` nearly equal runs, at
    multiples of `multiple` where n is one."""
    unit = multiple if n % multiple == 0 else 1
    units = n // unit
    return units * index // parts * unit, units * (index + 1) // parts * unit


@dataclass(frozen=True)
class HeadSlice:
    """One rank's attention heads: K/V heads [kv_start, kv_start + num_kv_heads) and the query
    heads that read them."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


class TensorParallel:
    """One rank's view of its group; with size 1 every collective is the identity."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group

    @classmethod
    def join(cls, rank: int, size: int, port: int, device: str) -> TensorParallel:
        """Rendezvous of `size` ranks on this host at `port` (rank 0 listens)."""
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT)
        if device == "cuda":
            group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        return cls(rank, size, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (summed in float32 where x is in half precision)."""
        if self.size == 1:
            return x
        total = x.float().contiguous() if x.device.type == "cpu" else x.contiguous()
        self.group.allreduce([total]).wait()
        return total.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [..., n] side by side along the last dimension: [..., size * n]."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def kv_head_ranges(self, num_heads: int, num_kv_heads: int) -> list[tuple[int, int]]:
        """Every rank's [start, end) of the model's K/V heads, rank 0's first (replicated heads: the
        same range on several ranks)."""
        slices = [TensorParallel(rank, self.size).head_slice(num_heads, num_kv_heads)
                  for rank in range(self.size)]
        return [(s.kv_start, s.kv_start + s.num_kv_heads) for s in slices]

    def head_slice(self, num_heads: int, num_kv_heads: int) -> HeadSlice:
        if num_kv_heads < self.size:  # each K/V head on several ranks, its query heads split among them
            if self.size % num_kv_heads or num_heads % self.size:
                raise ValueError(f"tensor_parallel_size={self.size} exceeds the model's {num_kv_heads} K/V "
                                 f"heads: it must then be a multiple of them that divides the {num_heads} "
                                 "query heads")
            per_rank = num_heads // self.size
            return HeadSlice(self.rank * per_rank, per_rank, self.rank * num_kv_heads // self.size, 1)
        kv_start, kv_end = split(num_kv_heads, self.size, self.rank)
        per_kv = num_heads // num_kv_heads
        return HeadSlice(kv_start * per_kv, (kv_end - kv_start) * per_kv, kv_start, kv_end - kv_start)

    def largest_kv_heads(self, num_heads: int, num_kv_heads: int) -> int:
        """The K/V heads of the rank that holds the most: what sizes every rank's KV pool."""
        return max(end - start for start, end in self.kv_head_ranges(num_heads, num_kv_heads))

    def width(self, n: int) -> tuple[int, int]:
        """This rank's run [start, end) of the MLP's width n."""
        return split(n, self.size, self.rank, INT4_GROUP)

    def vocab_shard(self, vocab_size: int) -> int:
        """Rows of the embedding and LM head per rank: the vocabulary padded to a multiple of size."""
        return -(-vocab_size // self.size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

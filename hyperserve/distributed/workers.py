"""Tensor-parallel worker processes: rank 0 is the engine's own process, ranks 1.. run here.

Each worker loads its slice of the model, allocates a KV pool of its own heads with rank 0's
block count, and then runs every forward pass that rank 0 runs, on the chunks rank 0 sends it
(the same block tables: the scheduler and the block pool live on rank 0 only), and on CUDA
captures its decode graphs when rank 0 captures its own. Between passes it hands rank 0 its heads
of KV blocks, or fills its heads of blocks from rank 0's (the disk tier and KV transfer move
whole blocks). Commands come over a pipe, which waits without a timeout while the server idles
and ends the worker when rank 0's process exits; a pass's tensors go over the group's
collectives, blocks over the pipe.
"""

from __future__ import annotations

import logging
import multiprocessing
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from hyperserve.config import EngineConfig
from hyperserve.distributed.group import TensorParallel, free_port

logger = logging.getLogger("hyperserve.distributed")

WORKER_START_TIMEOUT_S = 600  # loading a large model's slice


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed to start or stopped."""


@dataclass
class Forward:
    """A forward pass of rank 0's (ModelRunner.forward): its chunks, over the first num_layers
    layers for a self-draft (None: all)."""

    chunks: list
    num_layers: int | None = None


@dataclass
class ReadBlocks:
    """Rank 0's request for a worker's heads of these KV blocks (ModelRunner.read_blocks)."""

    block_ids: list[int]


@dataclass
class WriteBlocks:
    """A worker's heads of these KV blocks, to fill them with."""

    block_ids: list[int]
    tensors: dict[str, torch.Tensor]


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..size-1: starts them, sends them each step, stops them."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.parallel.tensor_parallel_size
        port = free_port()
        self.saved_threads = threads = torch.get_num_threads()
        if config.model.device == "cpu":  # the ranks share this machine's cores (given back by close)
            threads = max(1, threads // size)
            torch.set_num_threads(threads)
        context = multiprocessing.get_context("spawn")  # a forked torch with threads running is unsafe
        self.processes: list[multiprocessing.Process] = []
        self.pipes: list[Connection] = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker_main, args=(config, rank, size, port, threads, theirs),
                                      name=f"hyperserve-tp{rank}", daemon=True)
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        logger.info("tensor parallelism: started %d worker process(es); joining the group", size - 1)
        self.group = TensorParallel.join(0, size, port, config.model.device)

    def start(self, num_blocks: int, num_window_blocks: int | None) -> None:
        """Tell every worker its KV pool's size and wait until all have built their runners."""
        for pipe in self.pipes:
            pipe.send((num_blocks, num_window_blocks))
        for rank, pipe in enumerate(self.pipes, start=1):
            if not pipe.poll(WORKER_START_TIMEOUT_S):
                raise WorkerError(f"tensor-parallel rank {rank} did not start in {WORKER_START_TIMEOUT_S} s")
            reply = self._receive(rank, pipe)
            if reply != "ready":
                raise WorkerError(f"tensor-parallel rank {rank} failed to start:\n{reply}")

    def send(self, command: object) -> None:
        for rank in range(1, len(self.pipes) + 1):
            self._send(rank, command)

    def read_blocks(self, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """Each worker's heads of these blocks (on the CPU), rank 1's first."""
        self.send(ReadBlocks(block_ids))
        return [self._receive(rank, pipe) for rank, pipe in enumerate(self.pipes, start=1)]

    def write_blocks(self, block_ids: list[int], parts: list[dict[str, torch.Tensor]]) -> None:
        """parts[i]: rank i + 1's heads of these blocks."""
        for rank, tensors in enumerate(parts, start=1):
            self._send(rank, WriteBlocks(block_ids, {name: t.cpu() for name, t in tensors.items()}))

    def _send(self, rank: int, command: object) -> None:
        try:
            self.pipes[rank - 1].send(command)
        except (BrokenPipeError, EOFError, OSError) as error:
            raise WorkerError(f"tensor-parallel rank {rank} has stopped") from error

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        self.processes, self.pipes = [], []
        torch.set_num_threads(self.saved_threads)

    @staticmethod
    def _receive(rank: int, pipe: Connection) -> object:
        try:
            return pipe.recv()
        except EOFError:
            raise WorkerError(f"tensor-parallel rank {rank} has stopped (see its log)") from None


def _worker_main(config: EngineConfig, rank: int, size: int, port: int, threads: int,
                 pipe: Connection) -> None:
    """One worker's life: join, load, build, then follow rank 0's steps until told to stop."""
    from hyperserve.engine.lora_manager import LoRAManager
    from hyperserve.engine.model_runner import CAPTURE_GRAPHS, ModelRunner
    from hyperserve.models.loader import load_model

    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    try:
        if config.model.device == "cuda":
            torch.cuda.set_device(rank)
        tp = TensorParallel.join(rank, size, port, config.model.device)
        model = load_model(config, tp)
        lora = LoRAManager.of(model, config.lora)  # adapters are read here too, as a pass first runs one
        num_blocks, num_window_blocks = pipe.recv()
        runner = ModelRunner(model, config, num_blocks, lora=lora, num_window_blocks=num_window_blocks)
    except EOFError:
        return
    except BaseException:
        pipe.send(traceback.format_exc())
        return
    pipe.send("ready")
    while True:
        try:
            command = pipe.recv()  # Forward, ReadBlocks, WriteBlocks, CAPTURE_GRAPHS, or None: stop
        except EOFError:  # rank 0 is gone
            return
        if command is None:
            return
        if isinstance(command, Forward):
            layers = None if command.num_layers is None else runner.kv_caches[: command.num_layers]
            runner.forward(command.chunks, kv_caches=layers)
        elif isinstance(command, ReadBlocks):
            pipe.send({name: t.cpu() for name, t in runner.read_blocks(command.block_ids).items()})
        elif isinstance(command, WriteBlocks):
            runner.write_blocks(command.block_ids, command.tensors)
        elif command == CAPTURE_GRAPHS:
            runner.capture_graphs()

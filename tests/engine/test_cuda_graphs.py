"""Decode steps through DecodeGraphs' persistent, padded buffers against the plain decode path.
On CUDA the graphs are captured and replayed; on the CPU the same buffers and padding run eagerly
(with the Triton kernel in its interpreter), which checks everything but the capture itself."""

from __future__ import annotations

import pytest
import torch

from hyperserve import LLM
from hyperserve.engine.cuda_graphs import DecodeGraphs, batch_buckets, fastest_buckets
from hyperserve.engine.model_runner import SeqChunk
from tests.conftest import DEVICES, needs_triton, tiny_config


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_batches_go_to_a_larger_graph_only_where_it_is_clearly_faster():
    # H200, Llama-3-8B: cuBLAS's gate/up kernel at 448 rows is slower than at 512
    replay_ms = {256: 9.0, 432: 15.0, 448: 19.0, 464: 15.9, 480: 16.2, 496: 16.3, 512: 16.0}
    route = fastest_buckets(replay_ms)
    assert route == {256: 256, 432: 432, 448: 464, 464: 464, 480: 480, 496: 496, 512: 512}
    assert fastest_buckets({1: 1.0, 2: 0.99, 4: 1.2}) == {1: 1, 2: 2, 4: 4}  # within the margin: no padding
    assert fastest_buckets({1: 1.0, 2: 0.5, 4: 0.4}) == {1: 4, 2: 4, 4: 4}


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_graph_decode_matches_eager_decode(device, save_hf_model):
    _, path = save_hf_model(tiny_config("mistral", sliding_window=24))
    llm = LLM(model=path, num_kv_blocks=48, block_size=16, max_model_len=128, device=device, dtype="float32",
              attention_backend="triton", max_num_seqs=16, enforce_eager=True)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner._decode_logits, max_batch=16, max_blocks=8, block_size=16,
                          padding_slot=runner.padding_slot, sliding_window=24, device=runner.device,
                          use_cuda_graphs=device == "cuda")
    if device == "cuda":
        with torch.inference_mode():
            graphs.capture()
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 17, 40, 5, 33, 64, 1, 20, 50]  # ragged; batches of 9, 3 and 5 pad to 16, 4 and 8
    tables = [list(range(5 * i, 5 * i + 5)) for i in range(len(lengths))]
    with torch.inference_mode():
        for i, n in enumerate(lengths):  # prefill each sequence's context
            tokens = torch.randint(0, 256, (n,), generator=generator).tolist()
            runner.forward([SeqChunk(tokens, 0, tables[i], num_logits=0)])
        pool_before = runner.kv_caches[0].key[: runner.padding_slot].clone()
        for batch in (9, 3, 5):  # shrinking too: rows the last step used become padding
            tokens = [batch + i for i in range(batch)]  # new each step: stale rows would write wrong K/V
            chunks = [SeqChunk([t], n, table, num_logits=1) for t, n, table in zip(tokens, lengths, tables)]
            from_graphs = graphs.run(tokens, lengths[:batch], tables[:batch]).clone()
            pool_after = runner.kv_caches[0].key[: runner.padding_slot].clone()
            eager = runner.forward(chunks)  # rewrites the same slots with the same K/V
            torch.testing.assert_close(from_graphs, eager, atol=1e-4, rtol=0)
            # the graph step wrote only its sequences' new slots; padding rows wrote past the pool
            written = torch.tensor([tables[i][lengths[i] // 16] * 16 + lengths[i] % 16 for i in range(batch)])
            unchanged = torch.ones(runner.padding_slot, dtype=torch.bool)
            unchanged[written] = False
            assert torch.equal(pool_after[unchanged.to(pool_after.device)],
                               pool_before[unchanged.to(pool_before.device)])
            # the padding rows, up to the graph the batch ran in, write into the padding block
            bucket = graphs.route[next(b for b in graphs.buckets if b >= batch)]
            assert torch.all(graphs.slot_mapping[batch:bucket] == runner.padding_slot)
            pool_before = runner.kv_caches[0].key[: runner.padding_slot].clone()

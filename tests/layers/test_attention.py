"""KVCache's block reads and writes, as the disk tier and KV transfers between engines use them."""

from __future__ import annotations

import pytest
import torch

from hyperserve.layers.attention import KVCache


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_blocks_read_and_written_back_keep_every_byte(kv_cache_dtype):
    cache = KVCache.allocate(4, 16, 3, 64, torch.bfloat16, kv_cache_dtype, "cpu")
    for tensor in cache._tensors().values():
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8))
    read = cache.read_blocks(torch.tensor([1, 2]))
    assert all(t.shape[:2] == (2, 16) for t in read.values())
    cache.write_blocks(torch.tensor([3, 0]), read)  # float8 has no index_copy_ kernel: written as bytes
    back = cache.read_blocks(torch.tensor([3, 0]))
    assert all(torch.equal(back[name].view(torch.uint8), read[name].view(torch.uint8)) for name in read)
    untouched = cache.read_blocks(torch.tensor([1, 2]))
    assert all(torch.equal(untouched[name].view(torch.uint8), read[name].view(torch.uint8)) for name in read)

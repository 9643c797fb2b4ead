"""Weights moved into huge pages: the same numbers, shared tensors still shared, one block."""

from __future__ import annotations

import pytest
import torch

from hyperserve import kernels
from hyperserve.layers import huge_pages
from hyperserve.layers.attention import KVCache, TorchPagedAttention
from hyperserve.models.loader import build_model
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this machine")


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [huge_pages._get(*slot) for slot in huge_pages._tensor_slots(model)]


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_moved_weights_give_the_same_logits(monkeypatch, quantization):
    if quantization == "int4" and not kernels.available():
        pytest.skip("the native CPU kernels could not be built here")
    config = tiny_config("llama", tie_word_embeddings=True)

    def build() -> torch.nn.Module:
        return build_model(config, None, TorchPagedAttention(), 64, torch.float32, "cpu", seed=3,
                           quantization=quantization)

    moved = build()
    with monkeypatch.context() as patch:
        patch.setattr(huge_pages, "available", lambda: False)
        original = build()
    for a, b in zip(_tensors(original), _tensors(moved), strict=True):
        assert torch.equal(a, b)
    ids = torch.tensor([1, 7, 200, 255])
    assert torch.equal(original.compute_logits(original.embed(ids)), moved.compute_logits(moved.embed(ids)))

    tensors = _tensors(moved)
    first = min(t.data_ptr() for t in tensors)
    assert all(0 <= t.data_ptr() - first < 64 << 20 for t in tensors)  # one block (with no gaps of MBs)
    assert first % huge_pages.HUGE_PAGE == 0
    if quantization == "int4":  # the tied Q8_0 embedding and head: one tensor, as before the move
        assert moved.model.embed_tokens.q80 is moved.lm_head.q80
    else:
        assert moved.lm_head is None or moved.lm_head.weight.data_ptr() == moved.model.embed_tokens.weight.data_ptr()


def test_views_of_one_storage_stay_views_of_one_copy():
    module = torch.nn.Module()
    base = torch.arange(64, dtype=torch.float32)
    module.first, module.second = base[:32], base[16:48].view(4, 8)
    module.register_buffer("whole", base)
    assert huge_pages.move_to_huge_pages(module) == 256
    assert module.whole.data_ptr() == module.first.data_ptr() == module.second.data_ptr() - 16 * 4
    module.whole[20] = -1.0  # one memory, as before
    assert module.second[0, 4] == -1.0 and module.first[20] == -1.0


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            if "-" in line.split()[0] and not line.split()[0].endswith(":"):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                inside = start <= address < end
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_the_cpu_kv_pool_is_zero_until_written_and_faults_in_huge_pages():
    """Zeros as before, taking memory only where written (tests/engine/test_memory.py), now in 2 MiB
    pages (the kernel compacts memory for madvised faults, as the `madvise` defrag setting says)."""
    cache = KVCache.allocate(4096, 16, 3, 64, torch.bfloat16, "auto", "cpu")  # 12 MiB a tensor
    assert cache.key.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not cache.key.any() and not cache.value.any()
    assert _anon_huge_kb(cache.key.data_ptr()) == 0  # reading zeros takes no memory
    cache.key[: (4 << 20) // (3 * 64 * 2)] = 1.0  # the tokens of the first 4 MiB: two huge pages
    assert _anon_huge_kb(cache.key.data_ptr()) == 4096

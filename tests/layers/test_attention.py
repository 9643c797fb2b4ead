"""KVCache's block reads and writes, as the disk tier and KV transfers between engines use them;
the portable backend's capped attention and attention sinks."""

from __future__ import annotations

import pytest
import torch

from hyperserve.layers.attention import KVCache, sdpa


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


@pytest.mark.parametrize("mask_kind", ["causal", "prompt after context", "decodes"])
def test_capped_attention_matches_transformers_eager_attention(mask_kind):
    """SDPA cannot cap scores, so `sdpa` computes Gemma 2's capped attention in plain ops, a few hundred
    queries at a time: against transformers' Gemma 2 eager attention over 600 queries (three
    chunks), causal, a prompt after 100 tokens of context (an [n, L] mask), and decodes of
    different context lengths (a [B, 1, 1, L] mask, each query head's group of one)."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    generator = torch.Generator().manual_seed(0)
    shapes = {"causal": (1, 4, 2, 600, 600), "prompt after context": (1, 4, 2, 600, 700),
              "decodes": (3, 2, 2, 2, 40)}
    batch, heads, kv_heads, queries, keys = shapes[mask_kind]
    q = torch.randn(batch, heads, queries, 16, generator=generator) * 3
    k, v = (torch.randn(batch, kv_heads, keys, 16, generator=generator) * 3 for _ in range(2))
    if mask_kind == "decodes":
        allowed = torch.arange(keys) < torch.tensor([40, 25, 7])[:, None]  # [B, L]
        mask = allowed[:, None, None, :]
    else:
        allowed = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
        mask = None if mask_kind == "causal" else allowed
    out = sdpa(q, k, v, mask, mask_kind == "causal", 0.25, softcap=2.0)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    additive = additive[:, None, None, :] if mask_kind == "decodes" else additive
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25, softcap=2.0)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)
    uncapped = sdpa(q, k, v, mask, mask_kind == "causal", 0.25, softcap=None)
    assert not torch.allclose(out, uncapped, atol=1e-2)  # the cap bends these scores


@pytest.mark.parametrize("mask_kind", ["causal", "prompt after context", "decodes"])
def test_attention_sinks_match_transformers_eager_attention(mask_kind):
    """SDPA takes no attention sinks either: `sdpa` with GPT-OSS's (a logit per head joining each
    row's softmax) against transformers' GPT-OSS eager attention, as the capped test above."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    generator = torch.Generator().manual_seed(0)
    shapes = {"causal": (1, 4, 2, 300, 300), "prompt after context": (1, 4, 2, 300, 400),
              "decodes": (3, 4, 2, 1, 40)}
    batch, heads, kv_heads, queries, keys = shapes[mask_kind]
    q = torch.randn(batch, heads, queries, 16, generator=generator)
    k, v = (torch.randn(batch, kv_heads, keys, 16, generator=generator) for _ in range(2))
    sinks = torch.randn(heads, generator=generator) + 5  # about the log-sum-exp of a few hundred scores
    if mask_kind == "decodes":
        allowed = torch.arange(keys) < torch.tensor([40, 25, 7])[:, None]  # [B, L]
        mask = allowed[:, None, None, :]
    else:
        allowed = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
        mask = None if mask_kind == "causal" else allowed
    out = sdpa(q, k, v, mask, mask_kind == "causal", 0.25, sinks=sinks[:, None])
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    additive = additive[:, None, None, :] if mask_kind == "decodes" else additive
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, sinks=sinks)
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)
    without = sdpa(q, k, v, mask, mask_kind == "causal", 0.25)
    assert not torch.allclose(out, without, atol=1e-2)  # the sinks take their share


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_shared_cache_stores_reads_and_moves_its_one_tensor_once(kv_cache_dtype):
    """DeepSeek's latent cache: K and V one tensor (and one scale), written and gathered once, and
    blocks read and written as that tensor alone (half a separate cache's bytes on disk or the wire)."""
    cache = KVCache.allocate(4, 4, 1, 8, torch.float32, kv_cache_dtype, "cpu", shared=True)
    assert cache.shared and cache.value is cache.key and cache.value_scale is cache.key_scale
    latent = torch.randn(3, 1, 8)
    cache.write(torch.tensor([0, 5, 9]), latent, latent)
    k, v = cache.gather(torch.tensor([0, 1, 2]), torch.float32)
    assert k is v and torch.allclose(k[[0, 5, 9]], latent, atol=0.05 if kv_cache_dtype == "int8" else 0)
    read = cache.read_blocks(torch.tensor([1]))
    assert set(read) == ({"key"} if kv_cache_dtype == "auto" else {"key", "key_scale"})
    cache.write_blocks(torch.tensor([3]), read)
    assert torch.equal(cache.gather(torch.tensor([3]), torch.float32)[0], k[4:8])

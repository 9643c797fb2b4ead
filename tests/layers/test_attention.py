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
@pytest.mark.parametrize("model", ["gemma2", "gpt_oss"])
def test_what_sdpa_cannot_take_matches_transformers_eager_attention(model, mask_kind):
    """SDPA can neither cap scores (Gemma 2) nor take attention sinks (GPT-OSS: a logit per head
    joining each row's softmax), so `sdpa` computes those in plain ops, a few hundred queries at a
    time: against transformers' eager attention of each model over 600 queries (three chunks),
    causal, a prompt after 100 tokens of context (an [n, L] mask), and decodes of different context
    lengths (a [B, 1, 1, L] mask)."""
    import importlib
    from types import SimpleNamespace

    eager_attention_forward = importlib.import_module(
        f"transformers.models.{model}.modeling_{model}").eager_attention_forward
    generator = torch.Generator().manual_seed(0)
    shapes = {"causal": (1, 4, 2, 600, 600), "prompt after context": (1, 4, 2, 600, 700),
              "decodes": (3, 4, 2, 1, 40)}
    batch, heads, kv_heads, queries, keys = shapes[mask_kind]
    spread = 3 if model == "gemma2" else 1  # scores where the cap bends them
    q = torch.randn(batch, heads, queries, 16, generator=generator) * spread
    k, v = (torch.randn(batch, kv_heads, keys, 16, generator=generator) * spread for _ in range(2))
    if mask_kind == "decodes":
        allowed = torch.arange(keys) < torch.tensor([40, 25, 7])[:, None]  # [B, L]
        mask = allowed[:, None, None, :]
    else:
        allowed = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
        mask = None if mask_kind == "causal" else allowed
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    if model == "gemma2":
        ours, theirs = {"softcap": 2.0}, {"softcap": 2.0}
    else:  # sinks about the log-sum-exp of a few hundred scores, so that they take a share
        module.sinks = torch.randn(heads, generator=generator) + 5
        ours, theirs = {"sinks": module.sinks[:, None]}, {}
    out = sdpa(q, k, v, mask, mask_kind == "causal", 0.25, **ours)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    additive = additive[:, None, None, :] if mask_kind == "decodes" else additive
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25, **theirs)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)
    plain = sdpa(q, k, v, mask, mask_kind == "causal", 0.25)
    assert not torch.allclose(out, plain, atol=1e-2)  # the cap bends these scores; the sinks take a share


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

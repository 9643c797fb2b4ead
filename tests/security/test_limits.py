import asyncio
import time

import pytest

from hyperserve.security.config import Limits
from hyperserve.security.limits import InProcessLimiter, RateLimited, RedisLimiter

SLOW_MACHINE_TIMEOUT_S = 10.0


async def _burst(limiters, limits: Limits, count: int, key: str = "k") -> tuple[list, list]:
    async def one(i):
        try:
            return await limiters[i % len(limiters)].acquire(key, limits, 1)
        except RateLimited as error:
            return error
    results = await asyncio.gather(*(one(i) for i in range(count)))
    return [r for r in results if not isinstance(r, RateLimited)], [r for r in results if isinstance(r, RateLimited)]


def test_requests_per_minute_under_concurrent_load():
    granted, refused = asyncio.run(_burst([InProcessLimiter()], Limits(requests_per_minute=10), 50))
    assert len(granted) == 10 and len(refused) == 40
    assert refused[0].headers["Retry-After"] == "6"  # one request refills in 60/10 s
    assert refused[0].headers["x-ratelimit-remaining-requests"] == "0"
    assert granted[-1].headers["x-ratelimit-limit-requests"] == "10"


def test_tokens_concurrency_and_budget():
    limiter = InProcessLimiter()

    async def scenario():
        tokens = Limits(tokens_per_minute=1000)
        grant = await limiter.acquire("t", tokens, 600)
        with pytest.raises(RateLimited, match="1000 tokens per minute"):
            await limiter.acquire("t", tokens, 600)
        await limiter.release(grant, used_tokens=100)  # the estimate was high: 500 come back
        await limiter.acquire("t", tokens, 600)

        concurrency = Limits(concurrent_requests=2)
        grants = [await limiter.acquire("c", concurrency, 1) for _ in range(2)]
        with pytest.raises(RateLimited, match="2 concurrent requests"):
            await limiter.acquire("c", concurrency, 1)
        await limiter.release(grants[0], 1)
        await limiter.acquire("c", concurrency, 1)

        budget = Limits(token_budget=100, budget_period_s=3600)
        grant = await limiter.acquire("b", budget, 60)
        await limiter.release(grant, used_tokens=90)
        with pytest.raises(RateLimited, match="token budget exhausted: 90 of 100") as error:
            await limiter.acquire("b", budget, 20)
        assert int(error.value.headers["Retry-After"]) <= 3600

    asyncio.run(scenario())


def test_redis_limits_are_shared_by_replicas(redis_url):
    prefix = f"test-limits-{id(object())}:"

    async def scenario():
        # A generous timeout: 40 connections opening at once on a loaded CI machine can take more
        # than the default 0.5 s, and a timeout admits (fails open), which is not what this tests.
        replicas = [RedisLimiter(redis_url, prefix, timeout_s=SLOW_MACHINE_TIMEOUT_S) for _ in range(3)]
        granted, refused = await _burst(replicas, Limits(requests_per_minute=7), 40)
        assert len(granted) == 7 and len(refused) == 33
        concurrency = Limits(concurrent_requests=3)
        granted, _ = await _burst(replicas, concurrency, 10, key="c")
        assert len(granted) == 3
        await replicas[0].release(granted[0], 1)
        assert await replicas[1].acquire("c", concurrency, 1)

    asyncio.run(scenario())


def test_a_crashed_replicas_concurrency_slots_come_back(redis_url):
    """A replica that dies never releases; its leases expire and others admit again (and a live
    replica's acquires do not keep them alive)."""
    prefix = f"test-leases-{id(object())}:"
    concurrency = Limits(concurrent_requests=2)

    async def scenario():
        crashed = RedisLimiter(redis_url, prefix, lease_s=1.0, timeout_s=SLOW_MACHINE_TIMEOUT_S)
        await crashed.acquire("c", concurrency, 1)
        await crashed.acquire("c", concurrency, 1)  # ... and the replica dies holding both
        survivor = RedisLimiter(redis_url, prefix, lease_s=1.0, timeout_s=SLOW_MACHINE_TIMEOUT_S)
        with pytest.raises(RateLimited, match="2 concurrent requests"):
            await survivor.acquire("c", concurrency, 1)
        await asyncio.sleep(1.2)
        first = await survivor.acquire("c", concurrency, 1)
        await survivor.acquire("c", concurrency, 1)
        with pytest.raises(RateLimited):
            await survivor.acquire("c", concurrency, 1)
        await survivor.release(first, 1)
        assert await survivor.acquire("c", concurrency, 1)

    asyncio.run(scenario())


@pytest.mark.parametrize("fail_open", [True, False], ids=["open", "closed"])
def test_a_redis_that_hangs_or_dies_costs_one_timeout_then_the_documented_fallback(own_redis, fail_open):
    from hyperserve.common.errors import APIError

    limits = Limits(requests_per_minute=1)

    async def scenario():
        limiter = RedisLimiter(own_redis.url, "test-down:", timeout_s=0.3, fail_open=fail_open)
        grant = await limiter.acquire("k", limits, 1)
        for outage in (own_redis.pause, own_redis.stop):  # hung, then gone
            outage()
            started = time.perf_counter()
            if fail_open:
                assert (await limiter.acquire("k", limits, 1)).lease == ""  # admitted, past the limit of 1
            else:
                with pytest.raises(APIError) as refused:
                    await limiter.acquire("k", limits, 1)
                assert refused.value.status == 503 and refused.value.headers["Retry-After"]
            assert time.perf_counter() - started < 2
        started = time.perf_counter()
        await limiter.release(grant, 1)  # logged, not raised
        assert time.perf_counter() - started < 2

    asyncio.run(scenario())

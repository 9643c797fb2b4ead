"""Per-key rate limits: requests and tokens per minute (token buckets that refill continuously, as
OpenAI's limits do), concurrent requests, and a token budget per fixed period.

A request reserves 1 request and its estimated tokens (prompt + max_tokens) at admission, all
limits at once or none; when it ends, the estimate is replaced by the tokens it really used (the
token bucket may go into debt, which later requests wait out). Held in process by default, or in
Redis (one Lua script per step, so replicas sharing a key can never admit more than the limit).
In Redis a running request holds a lease that expires after LEASE_S, so the slots of a replica
that crashed come back by themselves. A Redis that is down or slower than its timeout either lets
requests through unlimited (`redis_unavailable: open`, the default: limits protect capacity and
budgets, and an outage of the limiter should not become an outage of the API) or refuses them
with 503 and Retry-After (`closed`, for budgets that must never be overrun).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field

from hyperserve.common.errors import unavailable
from hyperserve.security.config import Limits

logger = logging.getLogger("hyperserve.security")

# How long a request's concurrency slot lives in Redis without being released: longer than any
# request should run, short enough that a crashed replica's slots return within minutes.
LEASE_S = 900


@dataclass
class Grant:
    key: str
    limits: Limits
    estimated_tokens: int
    period: int  # the budget period charged, corrected on release even after a rollover
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* for the response
    lease: str = ""  # Redis: this request's concurrency slot


class RateLimited(Exception):
    def __init__(self, message: str, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.message, self.headers = message, {**headers, "Retry-After": str(max(1, math.ceil(retry_after_s)))}


def _duration(seconds: float) -> str:
    return f"{max(0.0, seconds):.3g}s"


def _headers(limits: Limits, requests_left: float, tokens_left: float) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers: the reset is the time until the bucket is full again."""
    headers = {}
    if limits.requests_per_minute:
        rate = limits.requests_per_minute / 60
        headers.update({"x-ratelimit-limit-requests": str(limits.requests_per_minute),
                        "x-ratelimit-remaining-requests": str(max(0, int(requests_left))),
                        "x-ratelimit-reset-requests": _duration((limits.requests_per_minute - requests_left) / rate)})
    if limits.tokens_per_minute:
        rate = limits.tokens_per_minute / 60
        headers.update({"x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
                        "x-ratelimit-remaining-tokens": str(max(0, int(tokens_left))),
                        "x-ratelimit-reset-tokens": _duration((limits.tokens_per_minute - tokens_left) / rate)})
    return headers


@dataclass
class _Bucket:
    level: float
    updated: float

    def refill(self, capacity: float, now: float) -> float:
        self.level = min(capacity, self.level + (now - self.updated) * capacity / 60)
        self.updated = now
        return self.level


@dataclass
class _KeyState:
    requests: _Bucket
    tokens: _Bucket
    running: int = 0
    budget_period: int = -1
    budget_used: int = 0


class InProcessLimiter:
    def __init__(self) -> None:
        self._states: dict[str, _KeyState] = {}
        self._lock = threading.Lock()

    def _state(self, key: str, limits: Limits, now: float) -> _KeyState:
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _KeyState(_Bucket(limits.requests_per_minute or 0, now),
                                                  _Bucket(limits.tokens_per_minute or 0, now))
        return state

    async def acquire(self, key: str, limits: Limits, estimated_tokens: int) -> Grant:
        now = time.time()
        with self._lock:
            s = self._state(key, limits, now)
            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            requests = s.requests.refill(rpm, now) if rpm else math.inf
            tokens = s.tokens.refill(tpm, now) if tpm else math.inf
            need = min(estimated_tokens, tpm) if tpm else estimated_tokens  # one request may use a full bucket
            headers = _headers(limits, requests, tokens)
            if requests < 1:
                raise RateLimited(f"rate limit reached: {rpm} requests per minute", (1 - requests) * 60 / rpm, headers)
            if tokens < need:
                raise RateLimited(f"rate limit reached: {tpm} tokens per minute (this request needs ~{need})",
                                  (need - tokens) * 60 / tpm, headers)
            if limits.concurrent_requests and s.running >= limits.concurrent_requests:
                raise RateLimited(f"rate limit reached: {limits.concurrent_requests} concurrent requests", 1, headers)
            period = int(now // limits.budget_period_s)
            if s.budget_period != period:
                s.budget_period, s.budget_used = period, 0
            if limits.token_budget and s.budget_used + need > limits.token_budget:
                reset = (period + 1) * limits.budget_period_s - now
                raise RateLimited(f"token budget exhausted: {s.budget_used} of {limits.token_budget} tokens used "
                                  f"this period", reset, headers)
            if rpm:
                s.requests.level -= 1
            if tpm:
                s.tokens.level -= need
            s.running += 1
            s.budget_used += need
            return Grant(key, limits, need, period, _headers(limits, requests - 1, tokens - need))

    async def release(self, grant: Grant, used_tokens: int) -> None:
        with self._lock:
            s = self._states[grant.key]
            s.running -= 1
            correction = used_tokens - grant.estimated_tokens
            if grant.limits.tokens_per_minute:
                s.tokens.level -= correction
            if s.budget_period == grant.period:
                s.budget_used += correction


# KEYS: requests bucket, tokens bucket, running leases (a sorted set: lease id -> expiry), budget
# counter (of the current period). ARGV: rpm, tpm, concurrency, budget, need, period_s, lease id,
# lease seconds. 0 means unlimited.
# Returns {status, requests_left, tokens_left, retry_after_ms, budget_used}; status 0 = granted,
# 1..4 = refused by requests, tokens, concurrency, budget.
_ACQUIRE = """
local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm, conc, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local need, period, lease, lease_s = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local function level(key, cap)
  if cap == 0 then return 1e18 end
  local v = redis.call('HMGET', key, 'level', 'updated')
  local l, u = tonumber(v[1]) or cap, tonumber(v[2]) or now
  return math.min(cap, l + (now - u) * cap / 60)
end
local req, tok = level(KEYS[1], rpm), level(KEYS[2], tpm)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)  -- leases of requests whose replica died
local running = redis.call('ZCARD', KEYS[3])
local used = tonumber(redis.call('GET', KEYS[4]) or '0')
if rpm > 0 and req < 1 then return {1, tostring(req), tostring(tok), math.ceil((1 - req) * 60000 / rpm), used} end
if tpm > 0 and tok < need then return {2, tostring(req), tostring(tok), math.ceil((need - tok) * 60000 / tpm), used} end
if conc > 0 and running >= conc then return {3, tostring(req), tostring(tok), 1000, used} end
if budget > 0 and used + need > budget then
  return {4, tostring(req), tostring(tok), math.ceil(((math.floor(now / period) + 1) * period - now) * 1000), used}
end
if rpm > 0 then redis.call('HSET', KEYS[1], 'level', req - 1, 'updated', now); redis.call('EXPIRE', KEYS[1], 120) end
if tpm > 0 then redis.call('HSET', KEYS[2], 'level', tok - need, 'updated', now); redis.call('EXPIRE', KEYS[2], 120) end
redis.call('ZADD', KEYS[3], now + lease_s, lease); redis.call('EXPIRE', KEYS[3], lease_s + 60)
redis.call('INCRBY', KEYS[4], need); redis.call('EXPIRE', KEYS[4], math.ceil(period) + 60)
return {0, tostring(req - 1), tostring(tok - need), 0, used + need}
"""

# KEYS as above; ARGV: tpm, correction (used - estimated), lease id.
_RELEASE = """
local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local tpm, correction = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[3])
if tpm > 0 then
  local v = redis.call('HMGET', KEYS[2], 'level', 'updated')
  local l, u = tonumber(v[1]) or tpm, tonumber(v[2]) or now
  redis.call('HSET', KEYS[2], 'level', math.min(tpm, l + (now - u) * tpm / 60) - correction, 'updated', now)
end
if correction ~= 0 then redis.call('INCRBY', KEYS[4], correction) end
return 0
"""


class RedisLimiter:
    """The same limits, shared by every replica that points at the same Redis."""

    def __init__(self, url: str, prefix: str, lease_s: float = LEASE_S, timeout_s: float = 0.5,
                 fail_open: bool = True) -> None:
        import redis.asyncio

        self.redis = redis.asyncio.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = prefix
        self.lease_s, self.timeout_s, self.fail_open = lease_s, timeout_s, fail_open
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._release = self.redis.register_script(_RELEASE)

    def _keys(self, key: str, period: int) -> list[str]:
        return [f"{self.prefix}{key}:{part}" for part in ("requests", "tokens", "running", f"budget:{period}")]

    async def acquire(self, key: str, limits: Limits, estimated_tokens: int) -> Grant:
        tpm = limits.tokens_per_minute or 0
        need = min(estimated_tokens, tpm) if tpm else estimated_tokens
        period = int(time.time() // limits.budget_period_s)
        lease = uuid.uuid4().hex
        try:
            status, requests, tokens, retry_ms, used = await asyncio.wait_for(self._acquire(
                keys=self._keys(key, period), args=[limits.requests_per_minute or 0, tpm,
                                                    limits.concurrent_requests or 0, limits.token_budget or 0, need,
                                                    limits.budget_period_s, lease, self.lease_s]), self.timeout_s)
        except Exception as error:  # Redis down or too slow: the documented fallback, never a hang
            logger.warning("rate limiter: Redis unavailable (%s: %s); %s", type(error).__name__, error,
                           "admitting without limits" if self.fail_open else "refusing")
            if self.fail_open:
                return Grant(key, limits, need, period)  # no lease: nothing to release
            raise unavailable("the rate limiter is unavailable; retry shortly") from error
        headers = _headers(limits, float(requests), float(tokens))
        if status:
            reason = {1: f"{limits.requests_per_minute} requests per minute",
                      2: f"{tpm} tokens per minute (this request needs ~{need})",
                      3: f"{limits.concurrent_requests} concurrent requests"}.get(int(status))
            message = (f"rate limit reached: {reason}" if reason else
                       f"token budget exhausted: {int(used)} of {limits.token_budget} tokens used this period")
            raise RateLimited(message, int(retry_ms) / 1000, headers)
        return Grant(key, limits, need, period, headers, lease)

    async def release(self, grant: Grant, used_tokens: int) -> None:
        if not grant.lease:
            return
        try:
            await asyncio.wait_for(self._release(keys=self._keys(grant.key, grant.period), args=[
                grant.limits.tokens_per_minute or 0, used_tokens - grant.estimated_tokens, grant.lease]),
                self.timeout_s)
        except Exception as error:  # the lease expires by itself; the token correction is lost
            logger.warning("rate limiter: release failed (%s: %s)", type(error).__name__, error)

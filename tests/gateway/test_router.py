from collections import Counter

import httpx
import pytest

from hyperserve.gateway.backends import Backend, CircuitBreaker
from hyperserve.gateway.config import RouteConfig
from hyperserve.gateway.router import Route, mean_logprob


def _backend(name: str, weight: float = 1.0, outstanding: int = 0) -> Backend:
    return Backend(name, f"http://{name}", None, weight, CircuitBreaker(failures=2, cooldown_s=10),
                   httpx.AsyncClient(), outstanding=outstanding)


def _route(*backends: Backend, **config) -> Route:
    return Route(RouteConfig(model="m", backends=[b.name for b in backends], **config),
                 [(b, b.weight) for b in backends])


def test_breaker_opens_after_consecutive_failures_and_probes_once_after_cooldown():
    breaker = CircuitBreaker(failures=2, cooldown_s=10)
    breaker.on_failure(now=0)
    assert breaker.allows(now=0)
    breaker.on_success()
    breaker.on_failure(now=1)
    breaker.on_failure(now=2)  # two in a row
    assert not breaker.allows(now=5)
    assert breaker.allows(now=12)
    breaker.on_attempt()  # the probe
    assert not breaker.allows(now=12)  # only one at a time
    breaker.on_failure(now=13)  # a failed probe reopens at once
    assert not breaker.allows(now=20) and breaker.allows(now=23)
    breaker.on_attempt()
    breaker.on_success()
    assert breaker.is_closed and breaker.allows(now=23)


def test_least_outstanding_counts_per_unit_of_weight():
    a, b = _backend("a", weight=1, outstanding=2), _backend("b", weight=4, outstanding=6)
    assert _route(a, b).pick(None, set()) is b  # (6+1)/4 < (2+1)/1
    a.outstanding = 0
    assert _route(a, b).pick(None, set()) is a


def test_pick_prefers_untried_backends_and_skips_open_circuits():
    a, b = _backend("a"), _backend("b", outstanding=5)
    route = _route(a, b)
    assert route.pick(None, {"a"}) is b
    for _ in range(2):
        b.breaker.on_failure(now=0)
    b.breaker.opened_at = float("inf")  # open, cooldown never over
    assert route.pick(None, {"a"}) is a  # the only one left, even though tried
    a.breaker.opened_at = float("inf")
    assert route.pick(None, set()) is None


def test_prefix_affinity_is_sticky_weighted_and_gives_way_under_load():
    a, b, c = _backend("a"), _backend("b"), _backend("c", weight=2)
    route = _route(a, b, c, balance="prefix-affinity", affinity_max_imbalance=3)
    keys = [f"system prompt {i}" for i in range(4000)]
    chosen = {key: route.pick(key, set()) for key in keys}
    assert all(route.pick(key, set()) is chosen[key] for key in keys[:100])
    shares = Counter(b.name for b in chosen.values())
    assert shares["c"] / len(keys) == pytest.approx(0.5, abs=0.04)  # weight 2 of 4
    assert shares["a"] / len(keys) == pytest.approx(0.25, abs=0.04)
    key = next(k for k in keys if chosen[k] is a)
    a.outstanding = 3
    assert route.pick(key, set()) is a  # within the allowed imbalance
    a.outstanding = 4
    assert route.pick(key, set()) is not a


def test_tenants_sharing_a_prefix_spread_over_backends_that_keep_their_caches_apart():
    """A backend that salts tenants' prefix caches holds one tenant's prefix for that tenant only:
    the prefix is placed per tenant there, and by itself where caches are shared."""
    a, b, c = _backend("a"), _backend("b"), _backend("c")
    shared = _route(a, b, c, balance="prefix-affinity")
    prefix = "You are a helpful assistant."
    keys = {shared.affinity_key(prefix, f"tenant {i}", None) for i in range(300)}
    assert keys == {prefix}  # no salt reaches these backends
    assert shared.affinity_key(prefix, None, "mine") == shared.affinity_key(prefix, "tenant 1", "mine") != prefix

    for backend in (a, b, c):
        backend.tenant_salt = True
    salted = _route(a, b, c, balance="prefix-affinity")
    picks = Counter(salted.pick(salted.affinity_key(prefix, f"tenant {i}", None), set()).name for i in range(300))
    assert set(picks) == {"a", "b", "c"} and max(picks.values()) < 150
    tenant = salted.affinity_key(prefix, "tenant 7", None)
    assert all(salted.pick(tenant, set()) is salted.pick(tenant, set()) for _ in range(20))  # sticky per tenant
    assert salted.affinity_key(prefix, "tenant 7", "x") != tenant  # the client's salt divides it further
    assert salted.affinity_key(None, "tenant 7", None) is None  # no prefix, no affinity


def test_mean_logprob_takes_the_least_confident_choice():
    chat = {"choices": [{"logprobs": {"content": [{"logprob": -0.2}, {"logprob": -0.4}]}},
                        {"logprobs": {"content": [{"logprob": -1.0}]}}]}
    assert mean_logprob(chat, chat=True) == pytest.approx(-1.0)
    completion = {"choices": [{"logprobs": {"token_logprobs": [-0.5, -1.5, None]}}]}
    assert mean_logprob(completion, chat=False) == pytest.approx(-1.0)
    assert mean_logprob({"choices": [{"logprobs": {"content": []}}]}, chat=True) == 0.0

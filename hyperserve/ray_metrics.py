"""The Ray Serve ingress's routing metrics, on its /metrics, and the Engine replicas it routes to.

A module of their own: Ray pickles the ingress app's functions and the request router by value
into the ingress process, and a module is pickled by name, so every reference reaches the same
registry there.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

REGISTRY = CollectorRegistry()
DECISIONS = Counter("hyperserve:ray_routing_decisions", "Replica choices: affinity (the prefix's replica first), "
                    "balance (it was too busy: least loaded first), no_key (no prompt: least loaded first)",
                    ["decision"], registry=REGISTRY)
IN_FLIGHT = Gauge("hyperserve:ray_replica_requests_in_flight", "Requests this ingress has in flight on each replica "
                  "(what Ray Serve's autoscaling counts, seen from here)", ["replica"], registry=REGISTRY)
# the unique ids of the Engine replicas the ingress's router routes to now, whose own /metrics the
# ingress's adds: PrefixAffinityRouter replaces it whole (it runs on Ray's router thread)
REPLICAS: frozenset[str] = frozenset()
RETRIED = Counter("hyperserve:ray_retried_requests", "Requests sent again because their replica died before "
                  "answering", registry=REGISTRY)

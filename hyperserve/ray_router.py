"""PrefixAffinityRouter: which Engine replica of the Ray Serve application takes a request.

Ray Serve pickles a request router's module by value into the process that routes (the ingress),
so this module holds the router alone; its metrics live in ray_metrics, pickled by name.
"""

from __future__ import annotations

from collections import defaultdict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from hyperserve import ray_metrics
from hyperserve.common.affinity import rendezvous_score


class PrefixAffinityRouter(RequestRouter):
    """Requests with the same prefix key to the same replica (rendezvous hashing), unless it has
    max_imbalance more in flight than the least loaded; requests without a key to the least loaded;
    a request that names its replica (the ingress reading each one's /metrics) to that one alone.
    Ray Serve tries the first group of replicas returned, then the next, each only while under its
    max_ongoing_requests. In-flight counts are this router's own: sends minus completions."""

    def initialize_state(self, max_imbalance: int = 4) -> None:
        self.max_imbalance = max_imbalance
        self._in_flight: dict[ReplicaID, int] = defaultdict(int)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if kwargs.get("replica") is not None:  # none while it is gone: the caller's timeout ends the wait
            return [[r for r in candidate_replicas if r.replica_id.unique_id == kwargs["replica"]]]
        by_load = sorted(candidate_replicas, key=lambda r: self._in_flight[r.replica_id])
        key = kwargs.get("prefix_key")
        if not by_load or not key:
            decision, ranked = "no_key", [by_load]
        else:
            preferred = max(by_load, key=lambda r: rendezvous_score(key, r.replica_id.unique_id))
            least = self._in_flight[by_load[0].replica_id]
            if self._in_flight[preferred.replica_id] <= least + self.max_imbalance:
                decision, ranked = "affinity", [[preferred], [r for r in by_load if r is not preferred]]
            else:
                decision, ranked = "balance", [by_load]
        ray_metrics.DECISIONS.labels(decision).inc()
        return ranked

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ray_metrics.REPLICAS = frozenset(r.replica_id.unique_id for r in replicas)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._in_flight[replica_id] += 1
        ray_metrics.IN_FLIGHT.labels(replica_id.unique_id).set(self._in_flight[replica_id])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if replica_id in self._in_flight:
            self._in_flight[replica_id] = max(0, self._in_flight[replica_id] - 1)
            ray_metrics.IN_FLIGHT.labels(replica_id.unique_id).set(self._in_flight[replica_id])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        ray_metrics.REPLICAS -= {replica_id.unique_id}
        if self._in_flight.pop(replica_id, None) is not None:
            ray_metrics.IN_FLIGHT.labels(replica_id.unique_id).set(0)

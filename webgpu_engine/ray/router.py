"""Prefix-affinity routing for the replicas (a Ray Serve request router, run in the process that
holds the deployment handle: the HTTP front).

Each engine call carries an affinity key: a hash of the start of its templated prompt (proxy.py),
about as many characters as the first KV blocks hold. A key seen before goes to the replica that
served it, whose prefix cache holds that prefix; when that replica is saturated (or gone) Ray's
routing falls through to the next rank, the least-loaded replicas. A new key goes to the
least-loaded replica (ties: the one owning fewest keys), so different conversations spread.
A request counts against its replica from the moment it is picked, not only once Ray has routed it:
a burst of requests picked before any is routed spreads as evenly as requests one at a time (a pick
never routed stops counting after PICK_TTL_S). Best effort: the key map lives in this process only and forgets keys past MAX_KEYS.
"""
from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MAX_KEYS = 65536
PICK_TTL_S = 30.0


def affinity_key(pending: PendingRequest | None) -> str | None:
    if pending is None:
        return None
    key: Any = pending.kwargs.get("affinity")
    return key if isinstance(key, str) and key else None


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._owner: OrderedDict[str, ReplicaID] = OrderedDict()     # key -> replica, LRU order
        self._ongoing: defaultdict[ReplicaID, int] = defaultdict(int)
        self._owned: defaultdict[ReplicaID, int] = defaultdict(int)
        self._by_request: dict[str, ReplicaID] = {}
        self._picked: dict[str, tuple[ReplicaID, float]] = {}   # request id -> (replica, when): not routed yet

    def _load(self, replica_id: ReplicaID) -> int:
        return self._ongoing[replica_id] + sum(1 for r, _ in self._picked.values() if r == replica_id)

    def _pick(self, pending: PendingRequest | None, replica_id: ReplicaID) -> None:
        if pending is None:
            return
        t = time.monotonic()
        for rid in [rid for rid, (_, at) in self._picked.items() if t - at > PICK_TTL_S]:
            del self._picked[rid]
        self._picked[pending.metadata.internal_request_id] = (replica_id, t)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = sorted(candidate_replicas, key=lambda r: (self._load(r.replica_id),
                                                             self._owned[r.replica_id],
                                                             r.replica_id.unique_id))
        key = affinity_key(pending_request)
        owner = self._owner.get(key) if key else None
        if owner is not None:
            first = [r for r in by_load if r.replica_id == owner]
            if first:
                self._pick(pending_request, owner)
                return [first, [r for r in by_load if r.replica_id != owner]]
        self._pick(pending_request, by_load[0].replica_id)
        return [by_load[:1], by_load[1:]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = pending_request.metadata.internal_request_id
        self._picked.pop(rid, None)
        self._ongoing[replica_id] += 1
        self._by_request[rid] = replica_id
        key = affinity_key(pending_request)
        if key is None:
            return
        old = self._owner.pop(key, None)
        if old is not None:
            self._owned[old] -= 1
        self._owner[key] = replica_id
        self._owned[replica_id] += 1
        while len(self._owner) > MAX_KEYS:
            _, gone = self._owner.popitem(last=False)
            self._owned[gone] -= 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._by_request.pop(internal_request_id, None) is not None:
            self._ongoing[replica_id] = max(0, self._ongoing[replica_id] - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        # its keys go to whichever replica serves them next
        super().on_replica_actor_died(replica_id)
        for k in [k for k, r in self._owner.items() if r == replica_id]:
            del self._owner[k]
        self._owned.pop(replica_id, None)
        for rid in [rid for rid, (r, _) in self._picked.items() if r == replica_id]:
            del self._picked[rid]
        self._ongoing.pop(replica_id, None)

"""The request router of the replica deployment: rendezvous hashing of the request's routing key.

A Ray Serve request router (:class:`ray.serve.request_router.RequestRouter`, Serve's custom request-routing API)
runs in every process that holds a handle to the deployment, here the ingress. :class:`DocumentRouter` reads the
routing key the ingress found (the documents' key, :mod:`rag_opt.server.ray_serve.keys`, or the request's own),
passed as the request's ``session_id``, and ranks the replicas by rendezvous (highest random weight) hashing
(:func:`~rag_opt.server.ray_serve.keys.rank_replicas`): the replica whose ``hash(key, replica id)`` is highest
serves the key, the next one is its fallback. Every ingress ranks alike (the ranking is a pure function of the key
and the set of replicas), and when a replica goes or comes, only the keys it served (or now serves) move. The
request goes to the first replica in that order whose queue has room (``max_ongoing_requests``): a replica at its
bound spills to the next (``fallback_replicas`` of them), and when all are full the request waits with Serve's
backoff. A request without a key goes to the less loaded of two replicas drawn at random, as Serve's default
router does.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from rag_opt.server.ray_serve.keys import rank_replicas

__all__ = ["DEFAULT_FALLBACK_REPLICAS", "DocumentRouter"]

DEFAULT_FALLBACK_REPLICAS = 1


class DocumentRouter(RequestRouter):
    """Routes a request carrying a routing key (its ``session_id``) to the replica rendezvous hashing picks for it,
    spilling to the next ``fallback_replicas`` (a ``request_router_kwargs`` entry; default 1) when it is full."""

    fallback_replicas = DEFAULT_FALLBACK_REPLICAS

    def initialize_state(self, **kwargs: Any) -> None:
        fallback = kwargs.get("fallback_replicas", DEFAULT_FALLBACK_REPLICAS)
        if isinstance(fallback, bool) or not isinstance(fallback, int) or fallback < 0:
            raise ValueError(f"fallback_replicas must be an integer >= 0, got {fallback!r}")
        self.fallback_replicas = fallback

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = ""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all ranks full: back off before retrying
            key = pending_request.metadata.session_id or ""
        if not key:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = rank_replicas(key, list(by_id))
        return [[by_id[r]] for r in ranked[: 1 + self.fallback_replicas]]

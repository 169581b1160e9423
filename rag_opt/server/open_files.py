"""How many client connections fit the process's open-file limit (``ulimit -n``): the connection layer
(:mod:`rag_opt.server.http`) and the upstream client (:mod:`rag_opt.server.upstream`) size themselves by it."""

from __future__ import annotations

__all__ = ["FD_RESERVE", "connection_limit"]

FD_RESERVE = 64  # file descriptors kept for the listening socket, logs, model files, ...


def connection_limit(requested: int) -> int:
    """``requested`` client connections (``--max-connections``), lowered to fit the process's open-file limit
    (``ulimit -n``): a third of what is left after :data:`FD_RESERVE` descriptors, for as many upstream
    connections and as many connections accepted in one burst before the proxy can refuse them."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return requested
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, (soft - FD_RESERVE) // 3))

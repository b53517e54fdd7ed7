"""Every request to the API server has a bound.

The kubernetes Python client waits forever by default: a request sent while the API server
restarts (its port open, not serving yet) or across a dropped connection hangs the calling
thread for good. A worker's heartbeat thread stuck like that is a false hang; an operator
pass stuck like that is a job nobody reconciles again. `bound_requests` gives every request
of an ApiClient a connect and a read timeout unless the call sets its own (a watch sets one
longer than its server-side timeout).

Duck-typed on purpose: this package does not import the kubernetes client.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

CONNECT_SECONDS = 5.0
READ_SECONDS = 30.0

Client = TypeVar("Client")


def bound_requests(api: Client, connect: float = CONNECT_SECONDS,
                   read: float = READ_SECONDS) -> Client:
    """`api` (a kubernetes ApiClient), its requests bounded; returns it."""
    rest: Any = cast(Any, api).rest_client
    unbounded = rest.request

    def request(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("_request_timeout"):
            kwargs["_request_timeout"] = (connect, read)
        return unbounded(*args, **kwargs)

    rest.request = request
    return api

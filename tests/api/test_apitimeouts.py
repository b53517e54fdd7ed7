"""Every request to the API server has a bound: a server that accepts the connection and
never answers (an API server starting up, a dropped connection) fails the call in time."""

from __future__ import annotations

import socket
import time

import pytest
from kubernetes import client
from urllib3.exceptions import HTTPError

from hlat_api.apitimeouts import bound_requests


def _silent_server() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # connections complete in the backlog; nothing is ever read or sent
    return server


def _client(port: int) -> client.ApiClient:
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{port}"
    config.retries = 0
    return client.ApiClient(config)


def test_a_request_to_a_server_that_never_answers_fails_within_its_bound() -> None:
    with _silent_server() as server:
        api = bound_requests(_client(server.getsockname()[1]), connect=1, read=0.5)
        began = time.monotonic()
        with pytest.raises(HTTPError, match=r"read timeout=0\.5"):
            client.CoordinationV1Api(api).read_namespaced_lease("l", "default")
        assert time.monotonic() - began < 5


def test_a_call_s_own_timeout_is_kept() -> None:
    with _silent_server() as server:
        api = bound_requests(_client(server.getsockname()[1]), connect=1, read=30)
        began = time.monotonic()
        with pytest.raises(HTTPError, match=r"read timeout=0\.5"):
            client.CoreV1Api(api).list_namespaced_pod("default", _request_timeout=(1, 0.5))
        # the message says which timeout ran out; the clock rules out the bound's 30 s. (< 5 s
        # failed once on a loaded machine, 2026-11-30, beside a full test run: the timed part
        # is the 0.5 s read plus the client's own work, which load stretches)
        assert time.monotonic() - began < 30

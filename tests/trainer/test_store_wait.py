"""A rank other than 0 waits for rank 0's store itself, polling, instead of c10d's half-second
retry after a refused connection (`distributed.await_store`)."""

from __future__ import annotations

import socket
import threading
import time

from hlat_trainer.distributed import await_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(port: int, rank: str = "1") -> dict[str, str]:
    return {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "RANK": rank}


def test_a_rank_returns_once_the_store_listens_having_connected_to_it() -> None:
    port = _free_port()
    accepted: list[float] = []

    def listen_later() -> None:
        time.sleep(0.3)
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(10)
            conn, _ = server.accept()
            accepted.append(time.monotonic())
            conn.close()

    listener = threading.Thread(target=listen_later)
    listener.start()
    began = time.monotonic()
    assert await_store(_env(port), bound=10)
    listener.join()
    assert accepted and accepted[0] - began >= 0.3


def test_without_a_store_it_gives_up_at_its_bound_and_leaves_the_rest_to_c10d() -> None:
    began = time.monotonic()
    assert not await_store(_env(_free_port()), bound=0.3)
    assert time.monotonic() - began >= 0.3


def test_rank_0_and_torchruns_agent_store_need_no_wait() -> None:
    closed = _free_port()  # nothing listens: a wait would time out
    assert await_store(_env(closed, rank="0"), bound=0.3)
    assert await_store({**_env(closed), "TORCHELASTIC_USE_AGENT_STORE": "True"}, bound=0.3)
    assert await_store({"RANK": "1"}, bound=0.3)  # one process: no rendezvous


def test_a_name_that_never_resolves_gives_up_at_the_bound() -> None:
    port = _free_port()
    env = {**_env(port), "MASTER_ADDR": "rank-0.not-yet.invalid"}
    assert not await_store(env, bound=0.3)

"""Which job's pass runs next when more are due than the operator has threads for.

Each job's loop runs its passes in a worker thread. With hundreds of jobs the passes due at
once (every job's resync timer, status refreshes) outnumber the threads, and a FIFO queue put
a job that a fault had just woken behind all of them: at 500 jobs a fault waited 20-30 s for a
thread (bench_operator_scale). The gate admits at most `slots` passes at a time and, when a slot
frees, gives it to a job a watch event woke before any job whose timer came round; a job already
waiting for its timer is moved ahead when an event about it arrives (`promote`). Within each
class, first come first served, so timed passes still run in turn, only later.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Hashable

PASS_SLOTS = 6
"""Passes run at once: the default executor's threads on a 2-core machine (min(32, cpus + 4));
a pass is mostly waiting on the API server, and CPU-bound work shares one interpreter lock."""


class PassGate:
    def __init__(self, slots: int = PASS_SLOTS) -> None:
        self.free = slots
        self._woken: deque[tuple[Hashable, asyncio.Future[None]]] = deque()
        self._timed: deque[tuple[Hashable, asyncio.Future[None]]] = deque()
        self._waiting: dict[Hashable, asyncio.Future[None]] = {}

    @property
    def queued(self) -> int:
        return sum(not f.done() for _, f in (*self._woken, *self._timed))

    @contextlib.asynccontextmanager
    async def slot(self, key: Hashable, woken: bool) -> AsyncIterator[None]:
        await self._acquire(key, woken)
        try:
            yield
        finally:
            self._release()

    def promote(self, key: Hashable) -> None:
        """An event about `key` arrived while its timed pass waits: it goes with the woken."""
        fut = self._waiting.get(key)
        if fut is None or fut.done():
            return
        for i, (k, f) in enumerate(self._timed):
            if f is fut:
                del self._timed[i]
                self._woken.append((k, f))
                return

    async def _acquire(self, key: Hashable, woken: bool) -> None:
        if self.free > 0 and not self.queued:
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._woken if woken else self._timed).append((key, fut))
        self._waiting[key] = fut
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot just as it was cancelled
                self._release()
            raise
        finally:
            if self._waiting.get(key) is fut:
                del self._waiting[key]

    def _release(self) -> None:
        for queue in (self._woken, self._timed):
            while queue:
                _, fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)  # the slot passes straight to it
                    return
        self.free += 1

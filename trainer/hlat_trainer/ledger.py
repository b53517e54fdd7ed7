"""Where a worker's time goes: seconds per activity since its attempt began.

One `Ledger` per process. Every second from the attempt's start (the launcher's start, handed
down as `HLAT_LAUNCHED_MONOTONIC`; the process's own start when not launched) is charged to
exactly one activity of `hlat_api.heartbeat.Activity`: the loop calls `charge(activity)` when
one ends, and the time since the previous call goes to it, less the parts it names
explicitly (a step's data wait and compilation). The clock is monotonic: wall-clock jumps do
not move time between activities. `snapshot()` is what the heartbeat carries, as of the last
charge, so the operator sees time only once it is known what it was spent on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from hlat_api import Env
from hlat_api.heartbeat import Activity

_IMPORTED = time.monotonic()
ACTIVITIES = tuple(Activity.model_fields)


def attempt_start(env: Mapping[str, str], fallback: float = _IMPORTED) -> float:
    """The monotonic time the attempt began: the launcher's start when it handed one down
    (the monotonic clock is the machine's, shared by every process on it)."""
    raw = env.get(Env.LAUNCHED_MONOTONIC, "")
    try:
        start = float(raw)
    except ValueError:
        return fallback
    return start if 0 < start <= time.monotonic() else fallback


class Ledger:
    def __init__(self, start: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.mark = attempt_start(os.environ) if start is None else start
        self.seconds = dict.fromkeys(ACTIVITIES, 0.0)

    def charge(self, activity: str, **parts: float) -> float:
        """Charge the time since the last charge to `activity`, less `parts` (seconds charged
        to the activities they name, each at most what is left); returns the time charged in
        all."""
        now = self.clock()
        elapsed = max(0.0, now - self.mark)
        self.mark = now
        left = elapsed
        for name, seconds in parts.items():
            share = min(max(0.0, seconds), left)
            self.seconds[name] += share
            left -= share
        self.seconds[activity] += left
        return elapsed

    def snapshot(self) -> Activity:
        return Activity(**{k: round(v, 3) for k, v in self.seconds.items()})

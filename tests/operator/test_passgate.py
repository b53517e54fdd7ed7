"""`passgate`: a job a watch event woke gets the next worker thread before the jobs whose
timer came round (at 500 jobs a fault used to wait 20-30 s behind them); never more passes at
once than slots; a cancelled waiter (a deleted job, the operator stopping) loses no slot."""

from __future__ import annotations

import asyncio

from hlat_operator.passgate import PassGate


async def _order(gate: PassGate, plan: list[tuple[str, bool]], promote: str | None = None
                 ) -> list[str]:
    """One holder takes the only slot; the `plan`'s jobs queue (name, woken) in that order;
    `promote` is an event arriving for a waiting job; the holder then releases."""
    ran: list[str] = []
    holder = gate.slot("holder", woken=False)
    await holder.__aenter__()

    async def job(name: str, woken: bool) -> None:
        async with gate.slot(name, woken):
            ran.append(name)
            await asyncio.sleep(0)

    tasks = []
    for name, woken in plan:
        tasks.append(asyncio.create_task(job(name, woken)))
        await asyncio.sleep(0)  # queued in this order
    if promote:
        gate.promote(promote)
    await holder.__aexit__(None, None, None)
    await asyncio.gather(*tasks)
    return ran


def test_woken_jobs_go_first_and_timed_ones_keep_their_turn() -> None:
    plan = [("timed-a", False), ("timed-b", False), ("woken-c", True), ("woken-d", True)]
    assert asyncio.run(_order(PassGate(1), plan)) == ["woken-c", "woken-d", "timed-a",
                                                      "timed-b"]


def test_an_event_for_a_waiting_job_moves_it_ahead() -> None:
    plan = [("timed-a", False), ("timed-b", False), ("woken-c", True)]
    assert asyncio.run(_order(PassGate(1), plan, promote="timed-b")) == [
        "woken-c", "timed-b", "timed-a"]


def test_never_more_passes_than_slots_and_a_cancelled_waiter_loses_no_slot() -> None:
    async def run() -> tuple[int, list[str]]:
        gate, inside, most, ran = PassGate(3), 0, 0, []

        async def job(name: str) -> None:
            nonlocal inside, most
            async with gate.slot(name, woken=name.endswith("w")):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.01)
                inside -= 1
                ran.append(name)

        tasks = [asyncio.create_task(job(f"j{i}{'w' if i % 3 else ''}")) for i in range(20)]
        await asyncio.sleep(0)
        tasks[10].cancel()  # waiting for a slot when cancelled
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.free == 3 and gate.queued == 0
        return most, ran

    most, ran = asyncio.run(run())
    assert most == 3 and len(ran) == 19

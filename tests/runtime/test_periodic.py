"""ServiceApp.every on a real server in-process: ticks survive a failing tick and stop with the drain."""

from __future__ import annotations

import asyncio

from services.runtime import ServiceApp, ServiceConfig


async def test_every_survives_a_failed_tick_and_stops_at_the_drain():
    app = ServiceApp("periodic", ServiceConfig(port=0, metrics_port=-1, drain_grace_s=0))
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(asyncio.get_running_loop().time())
        if len(ticks) == 1:
            raise RuntimeError("transient failure")

    app.every(0.01, tick)
    serving = asyncio.create_task(app.serve())
    for _ in range(500):
        if len(ticks) >= 3:
            break
        await asyncio.sleep(0.01)
    assert len(ticks) >= 3  # the first tick raised; later ones still ran
    app.request_stop()
    await asyncio.wait_for(serving, 10)
    stopped_at = len(ticks)
    await asyncio.sleep(0.05)
    assert len(ticks) == stopped_at

"""The operator's cleanup, against kopf's own daemon machinery (kopf 1.45.2, pinned): a timer that kopf spawned again
after its daemon killer ran (an event its workers still handled, `_core/reactor/processing.py:415-423`) kept the exit
waiting 5 s (`_core/reactor/running.py:413`; CI, stop 48: SIGTERM to exit 5.1 s)."""

from __future__ import annotations

import asyncio
import logging

import kopf
import pytest
from kopf._cogs.structs import bodies, ephemera, patches, references
from kopf._core.engines import daemons
from kopf._core.intents import causes, stoppers

from tokenmill_operator import handlers
from tokenmill_operator.crd import GROUP, PLURAL, VERSION
from tokenmill_operator.passes import PassScheduler


@pytest.mark.parametrize("started", [True, False], ids=["timer-sleeping", "timer-not-yet-started"])
def test_stopping_cancels_the_resource_timers_for_good(monkeypatch, started):
    monkeypatch.setattr(handlers, "SCHEDULER", PassScheduler(lambda key, stopped: None, lambda key, result: None))
    resource = references.Resource(GROUP, VERSION, PLURAL)
    registry = kopf.get_default_registry()
    body = bodies.Body({"apiVersion": f"{GROUP}/{VERSION}", "kind": "DatasetGeneration",
                        "metadata": {"name": "b5", "namespace": "team-a", "uid": "u-1"}})

    async def scenario() -> tuple[daemons.DaemonsMemory, asyncio.Task[None]]:
        memory = daemons.DaemonsMemory(live_fresh_body=body)
        cause = causes.SpawningCause(resource=resource, indices=ephemera.Memo(),
                                     logger=logging.getLogger("test"), memo=ephemera.Memo(), body=body,
                                     patch=patches.Patch(), reset=False)

        async def spawn() -> None:  # what kopf's worker does for each event of the resource
            memory.live_fresh_body = body
            await daemons.spawn_daemons(settings=kopf.OperatorSettings(),
                                        handlers=registry._spawning.get_handlers(cause=cause,
                                                                                 excluded=memory.forever_stopped),
                                        daemons=memory.running_daemons, cause=cause, memory=memory)

        await spawn()
        # kopf's daemon killer stops it for the exit; an event handled after that spawns it again (the CI case).
        await daemons.stop_daemon(settings=kopf.OperatorSettings(), daemon=memory.running_daemons[handlers.TIMER_ID],
                                  reason=stoppers.DaemonStoppingReason.OPERATOR_EXITING)
        await spawn()
        timer = memory.running_daemons[handlers.TIMER_ID].task
        assert not timer.done(), "kopf spawned it again"
        if started:
            await asyncio.sleep(0.05)  # in its initial delay
        await handlers.stop()
        await asyncio.wait_for(asyncio.gather(timer, return_exceptions=True), 1)
        await spawn()  # a later event
        await asyncio.sleep(0.05)
        return memory, timer

    memory, timer = asyncio.run(scenario())
    assert timer.cancelled()
    assert all(daemon.task is timer for daemon in memory.running_daemons.values()), "not spawned again"
    if started:  # kopf's runner ran its cleanup: the timer is forever stopped for this resource
        assert handlers.TIMER_ID in memory.forever_stopped and not memory.running_daemons

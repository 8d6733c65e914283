"""florist/busy_poll.py: the loop-turning task and its linger."""

from __future__ import annotations

import asyncio
import math

from florist.busy_poll import IdleFlag, keep_turning


def turns_of(linger_s: float, script) -> list[int]:
    """Run keep_turning(linger_s) beside `script(idle, sample)`; sample() -> turns so far."""
    async def main():
        idle, turns = IdleFlag(), [0]

        def nap() -> float:
            turns[0] += 1
            return 0.0

        task = asyncio.get_running_loop().create_task(keep_turning(idle, nap, linger_s))
        try:
            return await script(idle, lambda: turns[0])
        finally:
            task.cancel()
    return asyncio.run(main())


def test_idle_flag_is_an_event_with_its_complement():
    async def main():
        flag = IdleFlag()
        assert flag.is_set()
        busy = asyncio.get_running_loop().create_task(flag.wait_busy())
        await asyncio.sleep(0.01)
        assert not busy.done()
        flag.clear()
        await asyncio.wait_for(busy, 1)
        assert not flag.is_set()
        waiting = asyncio.get_running_loop().create_task(flag.wait())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        flag.set()
        await asyncio.wait_for(waiting, 1)
        await asyncio.wait_for(flag.wait(), 1)  # set: returns at once
    asyncio.run(main())


def test_a_linger_turns_the_loop_for_that_long_after_idle_then_sleeps_until_work_comes_and_goes():
    async def script(idle, sample):
        seen = []
        await asyncio.sleep(0.01)
        seen.append(sample())            # turning: the service fell idle at start
        await asyncio.sleep(0.25)        # past the 0.05 s linger
        a = sample()
        await asyncio.sleep(0.1)
        seen.append(sample() - a)        # asleep: no turns
        idle.clear()                     # a request in flight: no turns while busy
        await asyncio.sleep(0.02)
        b = sample()
        await asyncio.sleep(0.02)
        seen.append(sample() - b)
        idle.set()                       # idle again: turning for another linger
        await asyncio.sleep(0.02)
        seen.append(sample() - b)
        return seen
    started, asleep, busy, again = turns_of(0.05, script)
    assert started > 0 and asleep == 0 and busy == 0 and again > 0


def test_without_a_linger_the_loop_turns_while_idle_however_long():
    async def script(idle, sample):
        await asyncio.sleep(0.2)
        a = sample()
        await asyncio.sleep(0.05)
        later = sample() - a
        idle.clear()                     # busy: no turns, however long the linger
        await asyncio.sleep(0.01)
        b = sample()
        await asyncio.sleep(0.05)
        return [a, later, sample() - b]
    first, later, busy = turns_of(math.inf, script)
    assert first > 0 and later > 0 and busy == 0


def test_engine_server_refuses_a_negative_linger(capsys):
    from florist.server import cli

    assert cli.main(["--device", "cpu", "--busy-poll-linger-ms", "-1"]) == 2
    assert "--busy-poll-linger-ms must be 0 or more" in capsys.readouterr().err


def test_linger_defaults():
    from florist.busy_poll import DEFAULT_LINGER_MS, linger_seconds

    assert linger_seconds(True, 5.0, False) == math.inf  # busy poll: for ever, whatever the linger
    assert linger_seconds(False, None, True) == DEFAULT_LINGER_MS / 1e3 and linger_seconds(False, None, False) == 0.0
    assert linger_seconds(False, 7.5, False) == 0.0075 and linger_seconds(False, 0.0, True) == 0.0

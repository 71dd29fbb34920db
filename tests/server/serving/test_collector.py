"""A route's wait for its request's next event (Collector.next) and the end of a choice stream's pumps:
a client that leaves is never lost in a race with an event, and no task of a closed stream is left
pending (server/serving/ticket.py, server/api/choices.py)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from server.api.choices import ChoiceStreams
from server.serving.ticket import Collector

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no asyncio.timeout")


def run(coro):
    return asyncio.run(coro)


def test_next_returns_a_queued_event_at_once_and_none_after_the_timeout():
    async def main():
        c = Collector(asyncio.get_running_loop())
        c.queue.put_nowait("a")
        assert await c.next(0) == "a"  # queued: no wait, even with no time left
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await c.next(0.05) is None
        assert loop.time() - t0 >= 0.04
        loop.call_later(0.02, c.queue.put_nowait, "b")
        assert await c.next(5) == "b"

    run(main())


@pytest.mark.parametrize("yields", [0, 1, 2])
def test_a_cancel_that_comes_with_an_event_is_raised_and_the_event_stays_queued(yields):
    """The event and the cancellation in the same loop iterations: asyncio.wait_for (3.11) returned the
    event and dropped the cancel at yields 0 and 1."""

    async def main():
        c = Collector(asyncio.get_running_loop())
        waiter = asyncio.ensure_future(c.next(5))
        await asyncio.sleep(0.01)  # waiting on the queue
        c.queue.put_nowait("event")
        for _ in range(yields):
            await asyncio.sleep(0)
        if waiter.done():  # it took the event before the cancel: a plain completion
            assert waiter.result() == "event"
            return
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert c.queue.get_nowait() == "event"

    run(main())


class _Guard:
    """A choice's events: one at once, then nothing until cancelled; `swallow`: the first cancel is
    lost and one more event comes instead (what asyncio.wait_for did when an event came with it)."""

    def __init__(self, index: int, swallow: bool) -> None:
        self.index = index
        self.swallow = swallow

    async def events(self):
        yield f"first of {self.index}"
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not self.swallow:
                raise
        yield f"after the cancel, {self.index}"
        await asyncio.sleep(3600)


def _pumps() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "ChoiceStreams._pump" and not t.done()]


@pytest.mark.parametrize("swallow", [False, True])
def test_a_closed_choice_stream_leaves_no_pump_pending(swallow):
    """The response closes the merged stream (client gone) after one event: every choice's pump has ended
    by the time the close returns, even one that outlived a cancel."""

    async def main():
        streams = ChoiceStreams.__new__(ChoiceStreams)
        streams.guards = [_Guard(i, swallow) for i in range(4)]
        merged = streams.events()
        assert (await merged.__anext__())[1].startswith("first of")
        await asyncio.sleep(0.01)  # every pump has an event, the merged queue is full
        await asyncio.wait_for(merged.aclose(), 5)
        assert _pumps() == []

    run(main())

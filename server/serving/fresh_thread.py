"""Blocking calls that build an engine run on a new thread that ends with the call.

Why not `asyncio.to_thread` or the calling thread: libgomp (the OpenMP runtime torch and the C++
kernels use) keeps a thread team for every thread that has opened a parallel region, until that thread
exits, and once it manages more threads than the machine has CPUs it stops spinning between parallel
regions. A model load opens regions (packing, warm-up), so a load on the event loop's executor or on
the main thread leaves a team behind, and the engine worker's own team then sleeps between the ~300
regions of a decode step and waits for a futex wake-up in each: measured on a 2-vCPU Xeon with two
engine threads, SmolLM2-135M bf16 batch-1 steps took 25 ms on the worker against 12 ms when the
loading thread had exited (one thread: 22 ms either way).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def call_in_fresh_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a new thread, joined: its result, or its exception raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # handed to the caller, who decides
            box["error"] = exc

    thread = threading.Thread(target=run, name="tokenmill-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box.pop("error")
    return box["result"]


async def in_fresh_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a new thread, awaited without blocking the event loop. If the awaiting task is
    cancelled the call still runs to its end (a load cannot be interrupted) and its result is dropped."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while the call ran: nobody is waiting
            pass

    threading.Thread(target=run, name="tokenmill-load", daemon=True).start()
    return await done

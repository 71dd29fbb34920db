"""Engines are built on a thread that ends with the build (server/serving/fresh_thread.py): the helpers, and
every place the server builds one (startup in the app, `tokenmill serve`, admin loads)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from server import cli
from server.serving import loading
from server.serving.fresh_thread import call_in_fresh_thread, in_fresh_thread
from server.serving.loading import initial_versions

from ..helpers import make_settings


def _recorder(threads: list[threading.Thread], result: object = "built", error: Exception | None = None):
    def build(*args: object) -> object:
        threads.append(threading.current_thread())
        if error is not None:
            raise error
        return result

    return build


def test_call_in_fresh_thread_returns_raises_and_its_thread_has_ended():
    threads: list[threading.Thread] = []
    assert call_in_fresh_thread(_recorder(threads), 1, 2) == "built"
    with pytest.raises(ValueError, match="bad model"):
        call_in_fresh_thread(_recorder(threads, error=ValueError("bad model")))
    assert len(threads) == 2 and all(t is not threading.current_thread() and not t.is_alive() for t in threads)  # joined


def test_in_fresh_thread_awaits_without_blocking_the_loop():
    threads: list[threading.Thread] = []
    release = threading.Event()

    def slow() -> str:
        threads.append(threading.current_thread())
        assert release.wait(5)
        return "built"

    async def main() -> tuple[str, int]:
        ticks = 0
        task = asyncio.ensure_future(in_fresh_thread(slow))
        while not threads:
            await asyncio.sleep(0.005)
        for _ in range(5):  # the loop runs while the call blocks its own thread
            await asyncio.sleep(0.005)
            ticks += 1
        release.set()
        return await task, ticks

    assert asyncio.run(main()) == ("built", 5)
    threads[0].join(5)
    assert not threads[0].is_alive()
    with pytest.raises(RuntimeError, match="no engine"):
        asyncio.run(in_fresh_thread(_recorder(threads, error=RuntimeError("no engine"))))


def test_a_cancelled_wait_lets_the_call_finish_quietly():
    done = threading.Event()

    def build() -> str:
        done.wait(5)
        return "built"

    async def main() -> None:
        task = asyncio.ensure_future(in_fresh_thread(build))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done.set()
        await asyncio.sleep(0.05)  # the thread settles a cancelled future: nothing raised on the loop

    asyncio.run(main())


def test_the_app_builds_its_engine_on_a_thread_that_has_ended(tiny_model_path):
    threads: list[threading.Thread] = []
    engine = SimpleNamespace(model_name="m")
    settings = make_settings(model=tiny_model_path)
    loaded = asyncio.run(initial_versions(settings, None, _recorder(threads), _recorder(threads, engine)))
    assert loaded[0][1] is engine
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    threads[0].join(5)
    assert not threads[0].is_alive()


def test_tokenmill_serve_builds_the_engine_off_the_main_thread(monkeypatch, tiny_model_path):
    threads: list[threading.Thread] = []
    monkeypatch.setattr(loading, "build_engine", _recorder(threads, error=ValueError("cannot parse")))
    assert cli.main(["serve", "--model", tiny_model_path, "--port", "0"]) == 2
    threads[0].join(5)
    assert len(threads) == 1 and threads[0] is not threading.main_thread() and not threads[0].is_alive()

"""`tokenmill serve`'s server (server/cli.py DrainingServer: drain on SIGTERM, exit 0) over the tests'
FakeEngine, whose steps turn slow once the drain began: every step after SIGTERM takes `--slow-step-s`,
so at the drain deadline a step is always in flight and the engine worker cannot take the abort before
it ends. What test_shutdown.py runs to see every stream get its `error` event at the deadline anyway.

    python -m tests.server.serving.slow_drain_server --port 8012 --drain-timeout-s 1 --slow-step-s 4
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from types import FrameType

from server.app import create_app
from server.cli import DrainingServer, configure_logging, connection_guard
from server.config.settings import ServerSettings
from server.http.guarded_server import guarded_config

from ..fake_engine import FakeEngine


class SlowOnceDraining(FakeEngine):
    """A FakeEngine (a step of `step_delay_s`) whose steps take `slow_step_s` once `draining` is set."""

    def __init__(self, draining: threading.Event, slow_step_s: float) -> None:
        super().__init__(step_delay_s=0.02)
        self.draining, self.slow_step_s = draining, slow_step_s

    def step(self):
        if self.draining.is_set():
            time.sleep(self.slow_step_s)
        return super().step()


class SignalledServer(DrainingServer):
    """DrainingServer that sets `draining` when its first signal comes (the engine slows down then)."""

    def __init__(self, *args, draining: threading.Event, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.draining = draining

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.draining.set()
        super().handle_exit(sig, frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--drain-timeout-s", type=float, default=1.0)
    parser.add_argument("--slow-step-s", type=float, default=4.0)
    args = parser.parse_args()
    settings = ServerSettings(port=args.port, drain_timeout_s=args.drain_timeout_s, warmup=False, log_level="warning")
    configure_logging(settings.log_level)
    draining = threading.Event()
    app = create_app(settings, engine=SlowOnceDraining(draining, args.slow_step_s))
    guard = connection_guard(settings)
    config = guarded_config(app, guard, settings.keep_alive_timeout_s, host=settings.host, port=settings.port,
                            log_level=settings.log_level)  # fmt: skip
    server = SignalledServer(config, app, guard, settings.drain_timeout_s, draining=draining)
    server.run()
    if server.drained:  # as `tokenmill serve`: the worker may still be in its slow step
        os._exit(0)


if __name__ == "__main__":
    main()

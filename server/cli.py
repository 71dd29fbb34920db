"""`tokenmill` command line: `tokenmill serve [MODEL] [flags]` (also `python -m server`), `tokenmill bench ...`,
`tokenmill convert FILE.gguf OUT_DIR` (a GGUF file to a Hugging Face folder).

`serve MODEL` is `serve --model MODEL`, as `vllm serve MODEL`; vLLM's flags whose meaning we have are
settings under the same names, and any other flag is refused up front (server/config/vllm_flags.py).

`serve` loads the model before it binds the port: a model that cannot be loaded (a bad path, a bad
GGUF file, an unsupported architecture) ends it with one line on stderr naming the file and the
problem, and exit code 2, as invalid settings do.

`serve` raises the open-files limit, then runs uvicorn through the connection guard with a drain on
the first SIGTERM/SIGINT: readiness turns 503 (`draining`), new requests get 503, in-flight ones
finish within drain_timeout_s, the rest end with an error; exit 0, stalled clients or not. A second
signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import logging
import os
import resource
import sys
import threading
from collections.abc import Sequence
from types import FrameType

import uvicorn
from pydantic import ValidationError

from server.config.flags import add_flags, settings_from_flags
from server.config.settings import DRAIN_FLUSH_S, ServerSettings
from server.config.vllm_flags import flag_problems
from server.http.connections import FD_RESERVE, ConnectionGuard, raise_open_files_limit
from server.http.guarded_server import GuardedServer, guarded_config

SUBCOMMANDS = ("serve", "bench", "convert")
log = logging.getLogger("tokenmill.server")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] not in SUBCOMMANDS and args[0] not in ("-h", "--help")):
        args = ["serve", *args]  # `tokenmill --model X` means `tokenmill serve --model X`
    if args[0] == "bench":
        return _bench(args[1:])
    if args[0] == "convert":
        return _convert(args[1:])
    parser, serve_parser = build_parsers()
    if args[0] == "serve":
        problem = flag_problems(serve_parser, args[1:])
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
    parsed = parser.parse_args(args)
    return parsed.func(parsed)


def build_parser() -> argparse.ArgumentParser:
    return build_parsers()[0]


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `tokenmill` parser and its `serve` subparser."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve", help="run the HTTP server",
        description="Run the HTTP server. Settings: YAML file (--config), then TOKENMILL_* env, then flags.",
    )  # fmt: skip
    serve_parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                              help="the model to serve (same as --model), as in `vllm serve MODEL`")
    add_flags(serve_parser)
    serve_parser.set_defaults(func=serve)
    sub.add_parser("bench", help="benchmark a server (bench.cli), arguments passed through", add_help=False)
    sub.add_parser("convert", help="write a GGUF file as a Hugging Face folder (engine.weights.gguf.convert)",
                   add_help=False)
    return parser, serve_parser


def _bench(argv: list[str]) -> int:
    """`tokenmill bench ...` -> bench.cli.main(argv), when the bench package is installed."""
    if importlib.util.find_spec("bench") is None or importlib.util.find_spec("bench.cli") is None:
        print("tokenmill bench: the bench package (bench/cli.py) is not available", file=sys.stderr)
        return 2
    result = importlib.import_module("bench.cli").main(argv)
    return int(result or 0)


def _convert(argv: list[str]) -> int:
    """`tokenmill convert ...` -> engine.weights.gguf.convert.main(argv) (loads torch, so imported only here)."""
    return int(importlib.import_module("engine.weights.gguf.convert").main(argv) or 0)


def serve_settings(args: argparse.Namespace) -> ServerSettings:
    """Settings from `serve`'s parsed arguments: the positional MODEL is --model. Raises ValueError
    (the model given twice), pydantic.ValidationError, FileNotFoundError."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if getattr(args, "model", tag) != tag:
            raise ValueError(f"the model is given twice: {tag} and --model {args.model}")
        args.model = tag
    return settings_from_flags(args)


def settings_error(exc: Exception) -> str:
    """A settings error as one line per problem, naming the field and never quoting its value: a value may
    be a key (api_keys, tenants), and this text goes to the terminal and the logs."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    problems = [f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
                for e in exc.errors(include_url=False, include_input=False)]  # fmt: skip
    return f"{len(problems)} problem(s)\n  " + "\n  ".join(problems)


def serve(args: argparse.Namespace) -> int:
    try:
        settings = serve_settings(args)
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        print(f"tokenmill serve: invalid settings: {settings_error(exc)}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_prompts)
    guard = connection_guard(settings)
    from server.app import create_app
    from server.config.default_model import with_default_model
    from server.serving.fresh_thread import call_in_fresh_thread
    from server.serving.loading import build_engine, open_kv_events

    settings = with_default_model(settings)
    try:
        kv_events = open_kv_events(settings)  # bound before any engine loads: each one publishes into it
    except ValueError as exc:
        print(f"tokenmill serve: {exc}", file=sys.stderr)
        return 2
    engine = None
    if settings.model or not (settings.models or settings.models_dir):  # one model: load it before binding
        try:
            # not on this thread: server/serving/fresh_thread.py
            engine = call_in_fresh_thread(build_engine, settings, kv_events)
        except (ValueError, OSError) as exc:  # GGUFError is a ValueError: "FILE: problem"
            print(f"tokenmill serve: cannot load the model: {exc}", file=sys.stderr)
            if kv_events is not None:
                kv_events.close()
            return 2
    app = create_app(settings, engine=engine, kv_events=kv_events)
    config = guarded_config(app, guard, settings.keep_alive_timeout_s, host=settings.host, port=settings.port,
                            log_level=settings.log_level)  # fmt: skip
    server = DrainingServer(config, app, guard, settings.drain_timeout_s)
    server.run()
    if server.drained:
        # Skip the interpreter's teardown (about a second with torch loaded, and it joins idle tokenizer
        # threads): the drain deadline is the process's, not only the server's.
        logging.shutdown()
        os._exit(0)
    return 0 if server.started else 1


def connection_guard(settings: ServerSettings) -> ConnectionGuard:
    """The guard for this process: its cap follows the (raised) open-files limit unless configured."""
    open_files = open_files_limit()
    limits = settings.connection_limits(open_files)
    if limits.max_connections > open_files - FD_RESERVE:
        log.warning("max_connections %d leaves fewer than %d of the %d open files for the process: accept() "
                    "may fail at the limit", limits.max_connections, FD_RESERVE, open_files)  # fmt: skip
    log.info("connections: at most %d; timeouts: headers %gs, body %gs, keep-alive %gs, write %gs",
             limits.max_connections, limits.header_timeout_s, limits.body_timeout_s, limits.keep_alive_timeout_s,
             limits.write_timeout_s)  # fmt: skip
    return ConnectionGuard(limits)


def open_files_limit() -> int:
    """Raise the soft open-files limit toward the hard one and log both; returns the soft limit."""
    before, after, hard = raise_open_files_limit()
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if after > before:
        log.info("open-files limit raised from %d to %d (hard limit %s)", before, after, shown)
    else:
        log.info("open-files limit %d (hard limit %s)", after, shown)
    return after


def configure_logging(level: str, log_prompts: bool = False) -> None:
    """Plain lines for the server; bare JSON lines (one per request) for `tokenmill.requests`.
    sse-starlette logs every streamed chunk at debug: that logger stays at info unless --log-prompts."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    requests = logging.getLogger("tokenmill.requests")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    requests.addHandler(handler)
    requests.propagate = False
    if not log_prompts:
        logging.getLogger("sse_starlette").setLevel(max(logging.INFO, logging.getLevelName(level.upper())))


class DrainingServer(GuardedServer):
    """The server of `tokenmill serve`: its first SIGTERM/SIGINT drains the app, then exits 0 (plain
    uvicorn re-raises the signal). The drain deadline is absolute: at drain_timeout_s the requests
    left are ended at once, not after the engine's step in flight (streams get an `error` event where
    the socket still takes it), FLUSH_S later the connections left are closed, and a watchdog ends the
    process at drain_timeout_s + WATCHDOG_S whatever still runs."""

    FLUSH_S = DRAIN_FLUSH_S  # after the drain deadline: time for the error events to go out (0.5 s)
    WATCHDOG_S = 1.8  # after the drain deadline: the process exits 0 even if shutdown hangs

    def __init__(self, config: uvicorn.Config, app, guard: ConnectionGuard, drain_timeout_s: float) -> None:
        super().__init__(config, app, guard)
        self._app = app
        self._drain_timeout_s = drain_timeout_s
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None
        self.drained = False  # the drain ran: the process may exit without the interpreter's teardown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        runtime = getattr(self._app.state, "runtime", None)
        if runtime is None or self._drain_requested:
            self.force_exit = self._drain_requested or self.should_exit  # a second signal: stop now
            self.should_exit = True
            return
        self._drain_requested = True
        log.info("signal %d: draining", sig)
        watchdog = threading.Timer(self._drain_timeout_s + self.WATCHDOG_S, _exit_now)
        watchdog.daemon = True
        watchdog.start()
        runtime.loop.call_soon_threadsafe(self._start_drain, runtime)

    def _start_drain(self, runtime) -> None:
        self._drain_task = runtime.loop.create_task(self._drain_then_exit(runtime))

    async def _drain_then_exit(self, runtime) -> None:
        try:  # drain() ends by itself FLUSH_S after its deadline; this bound only guards against a hang there
            await asyncio.wait_for(runtime.drain(), self._drain_timeout_s + self.FLUSH_S + 0.2)
        except asyncio.TimeoutError:
            log.warning("drain deadline: closing %d responses still open", runtime.open_responses)
        finally:
            # Close what is left before uvicorn (and sse-starlette's own exit watch) see should_exit:
            # a stream then ends on its disconnect instead of being cancelled mid-send.
            self.guard.drop_all("shutdown")
            self.drained = True
            self.should_exit = True


def _exit_now() -> None:
    log.error("shutdown did not finish within drain_timeout_s + %.1fs: exiting now", DrainingServer.WATCHDOG_S)
    logging.shutdown()
    os._exit(0)

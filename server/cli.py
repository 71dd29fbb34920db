"""`tokenmill` command line: `tokenmill serve [flags]` (also `python -m server`), `tokenmill bench ...`,
`tokenmill convert FILE.gguf OUT_DIR` (a GGUF file to a Hugging Face folder).

`serve` loads the model before it binds the port: a model that cannot be loaded (a bad path, a bad
GGUF file, an unsupported architecture) ends it with one line on stderr naming the file and the
problem, and exit code 2, as invalid settings do.

`serve` runs uvicorn with a drain on the first SIGTERM/SIGINT: readiness turns 503 (`draining`), new
requests get 503, in-flight ones finish within drain_timeout_s, the rest end with an error; exit 0.
A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn
from pydantic import ValidationError

from server.settings import add_flags, settings_from_flags

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
    parsed = build_parser().parse_args(args)
    return parsed.func(parsed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve", help="run the HTTP server",
        description="Run the HTTP server. Settings: YAML file (--config), then TOKENMILL_* env, then flags.",
    )  # fmt: skip
    add_flags(serve_parser)
    serve_parser.set_defaults(func=serve)
    sub.add_parser("bench", help="benchmark a server (bench.cli), arguments passed through", add_help=False)
    sub.add_parser("convert", help="write a GGUF file as a Hugging Face folder (engine.gguf.convert)",
                   add_help=False)
    return parser


def _bench(argv: list[str]) -> int:
    """`tokenmill bench ...` -> bench.cli.main(argv), when the bench package is installed."""
    if importlib.util.find_spec("bench") is None or importlib.util.find_spec("bench.cli") is None:
        print("tokenmill bench: the bench package (bench/cli.py) is not available", file=sys.stderr)
        return 2
    result = importlib.import_module("bench.cli").main(argv)
    return int(result or 0)


def _convert(argv: list[str]) -> int:
    """`tokenmill convert ...` -> engine.gguf.convert.main(argv) (loads torch, so imported only here)."""
    return int(importlib.import_module("engine.gguf.convert").main(argv) or 0)


def serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_flags(args)
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        print(f"tokenmill serve: invalid settings: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    from server.app import create_app
    from server.default_model import with_default_model
    from server.runtime import build_engine

    settings = with_default_model(settings)
    try:
        engine = build_engine(settings)
    except (ValueError, OSError) as exc:  # GGUFError is a ValueError: "FILE: problem"
        print(f"tokenmill serve: cannot load the model: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, engine=engine)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            lifespan="on", access_log=False, log_config=None)
    server = DrainingServer(config, app)
    server.run()
    return 0 if server.started else 1


def configure_logging(level: str) -> None:
    """Plain lines for the server; bare JSON lines (one per request) for `tokenmill.requests`."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    requests = logging.getLogger("tokenmill.requests")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    requests.addHandler(handler)
    requests.propagate = False


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the app before exiting, and exits 0
    (it does not re-raise the signal as plain uvicorn does)."""

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self._app = app
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        runtime = getattr(self._app.state, "runtime", None)
        if runtime is None or self._drain_requested:
            self.force_exit = self._drain_requested or self.should_exit  # a second signal: stop now
            self.should_exit = True
            return
        self._drain_requested = True
        log.info("signal %d: draining", sig)
        runtime.loop.call_soon_threadsafe(self._start_drain, runtime)

    def _start_drain(self, runtime) -> None:
        self._drain_task = runtime.loop.create_task(self._drain_then_exit(runtime))

    async def _drain_then_exit(self, runtime) -> None:
        try:
            await runtime.drain()
        finally:
            self.should_exit = True

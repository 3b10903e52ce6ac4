"""`tokenmill sim-server`: the simulator as a `tokenmill` subcommand, added through the `tokenmill.commands` entry
point (so the runner's CLI never imports the simulator to offer it)."""

from __future__ import annotations

import argparse

from .config import add_arguments, config_from_args

# What to install; the runner says the same where this package is absent (tokenmill_runner/builtin_sim.py).
MISSING_HINT = "install tokenmill[sim] (or the tokenmill-sim package in runner/sim/)"


def register(commands: argparse._SubParsersAction) -> None:
    sim = commands.add_parser("sim-server", help="the SGLang-compatible simulator (/generate, /health, /metrics…)")
    add_arguments(sim)
    sim.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        from .server import serve
    except ModuleNotFoundError as error:  # the package is here but a library its server needs (aiohttp) is not
        raise RuntimeError(f"the simulator needs {error.name}, which is not installed: {MISSING_HINT}") from None
    serve(config_from_args(args), args.host, args.port)
    return 0

"""The built-in SGLang simulator (package tokenmill_sim), as the runner reaches it: started for `tokenmill run`
without --server, and a clear error where it is not installed (the runner image has no simulator). The runner's
only import of tokenmill_sim is here, inside `start`; `tokenmill sim-server` itself comes from the simulator's own
`tokenmill.commands` entry point."""

from __future__ import annotations

import argparse
from contextlib import ExitStack

INSTALL_HINT = "install tokenmill[sim] (or the tokenmill-sim package in runner/sim/)"


class SimulatorMissing(RuntimeError):
    """The simulator, or a library it needs, is not installed here."""


def start(stack: ExitStack, model_folder: str, *, seed: int, time_scale: float, max_running_requests: int,
          trust_remote_code: bool = False, aux_hidden_states: bool = False,
          aux_layer_ids: list[int] | None = None) -> str:
    """Start the simulator on a free loopback port for the life of `stack`; its base URL."""
    try:
        from tokenmill_sim.config import SimConfig
        from tokenmill_sim.server import SimServer
    except ModuleNotFoundError as error:
        raise SimulatorMissing(
            f"tokenmill run without --server starts the built-in SGLang simulator, but {error.name} is not "
            f"installed here: pass --server URL, or {INSTALL_HINT}"
        ) from None
    config = SimConfig(model_path=model_folder, seed=seed, time_scale=time_scale,
                       max_running_requests=max_running_requests, trust_remote_code=trust_remote_code,
                       enable_return_aux_hidden_states=aux_hidden_states,
                       return_aux_hidden_state_layer_ids=",".join(map(str, aux_layer_ids)) if aux_layer_ids else None)
    return stack.enter_context(SimServer(config)).url


def add_missing_sim_server(commands: argparse._SubParsersAction) -> None:
    """`tokenmill sim-server` where the simulator is not installed: say what to install, not 'invalid choice'."""
    # Whatever flags follow are taken as they are ("-" is no option prefix here): the answer is the same.
    parser = commands.add_parser("sim-server", add_help=False, prefix_chars="\0",
                                 help=f"the SGLang-compatible simulator (not installed here: {INSTALL_HINT})")
    parser.add_argument("arguments", nargs="*")
    parser.set_defaults(handler=_missing)


def _missing(args: argparse.Namespace) -> int:
    raise SimulatorMissing(f"the SGLang simulator (tokenmill_sim) is not installed here: {INSTALL_HINT}")

"""An SGLang-compatible simulator: the stand-in for SGLang where there is no GPU (`tokenmill sim-server`).

Pure parts (output lengths, token structure, the capacity model, the wire format) live in their own modules and are
tested without a server; `server` puts them behind aiohttp with SGLang's endpoints, metrics and fault injection.
"""

from .config import SimConfig, add_arguments, config_from_args
from .server import SimServer, build_app, serve

__all__ = ["SimConfig", "SimServer", "add_arguments", "build_app", "config_from_args", "serve"]

"""An SGLang-compatible simulator: the stand-in for SGLang where there is no GPU (`tokenmill sim-server`).

Pure parts (output lengths, token structure, the capacity model, the wire format, the settings) live in their own
modules and are tested without a server; `server` puts them behind aiohttp with SGLang's endpoints, metrics and
fault injection, and `loader` reads the model folder with transformers. Import what you need from its module
(`tokenmill_sim.config.SimConfig`, `tokenmill_sim.server.SimServer`): this package imports nothing, so its pure
parts load without aiohttp or transformers.
"""

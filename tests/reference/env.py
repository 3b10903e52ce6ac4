"""The reference environment: a virtualenv pinned the way SGLang's image pins it, built once and cached.

`reference_python()` returns its interpreter, building `~/.cache/tokenmill/refenv-<key>/` on first use (a few
packages from PyPI, ~30 s); the key hashes requirements.txt and the Python version, so a changed pin builds a new
environment and an unchanged one is reused. `reference_ids()` runs reference_ids.py there.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from tests.venv_cache import cached_python, env_key

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"


def reference_python() -> Path:
    return cached_python("refenv", env_key(REQUIREMENTS.read_bytes()), [["-r", str(REQUIREMENTS)]])


def reference_ids(prompts: Path, fixtures: dict[str, dict]) -> dict:
    """{"versions": {...}, "fixtures": {name: {"loader", "results": {sample_id: {"ids"} | {"error"}}}}}."""
    request = {"prompts": str(prompts), "fixtures": fixtures}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(request, handle)
        handle.flush()
        env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
        done = subprocess.run([str(reference_python()), str(HERE / "reference_ids.py"), handle.name],
                              capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"reference_ids.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)

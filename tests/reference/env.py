"""The reference environment: a virtualenv pinned the way SGLang's image pins it, built once and cached.

`reference_python()` returns its interpreter, building `~/.cache/tokenmill/refenv-<key>/` on first use (a few
packages from PyPI, ~30 s); the key hashes requirements.txt and the Python version, so a changed pin builds a new
environment and an unchanged one is reused. `reference_ids()` runs reference_ids.py there.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def env_key() -> str:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:12]
    return f"py{sys.version_info.major}{sys.version_info.minor}-{digest}"


def reference_python() -> Path:
    target = cache_root() / f"refenv-{env_key()}"
    python = target / "bin" / "python"
    ready = target / ".ready"
    if ready.exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".refenv-{env_key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers build it once
        if not ready.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "-r", str(REQUIREMENTS)], check=True)
            ready.write_text(env_key())
    return python


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

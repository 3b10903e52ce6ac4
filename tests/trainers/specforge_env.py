"""SpecForge's own pre-tokenized reader, run as it ships: a virtualenv with `specforge==0.2.0 --no-deps`.

Built once under ~/.cache/tokenmill/specforge-<key>/ (one 0.4 MB wheel from PyPI, a few seconds; the key hashes
requirements-specforge.txt and the Python version), like tests/reference/env.py. `read_prompts(path)` runs
`specforge.data.prompt_builder.prepare_prompt_tasks` on a file there and returns its tasks, or its error message.
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
from typing import Any

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-specforge.txt"

READ = """
import json, sys
from specforge.data.prompt_builder import prepare_prompt_tasks
try:
    tasks = prepare_prompt_tasks(sys.argv[1], None, chat_template=None, max_length=int(sys.argv[2]),
                                 is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None,
                                 num_proc=1)
except ValueError as error:
    print(json.dumps({"error": str(error)}))
else:
    print(json.dumps({"tasks": list(tasks)}))
"""


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def env_key() -> str:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:12]
    return f"py{sys.version_info.major}{sys.version_info.minor}-{digest}"


def specforge_python() -> Path:
    target = cache_root() / f"specforge-{env_key()}"
    python = target / "bin" / "python"
    ready = target / ".ready"
    if ready.exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".specforge-{env_key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers build it once
        if not ready.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "-r", str(REQUIREMENTS)], check=True)
            ready.write_text(env_key())
    return python


def read_prompts(path: Path, max_length: int = 1 << 20) -> dict[str, Any]:
    """{"tasks": [{"payload": {"input_ids", "loss_mask"}}, ...]} or {"error": message}, from SpecForge itself."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run([str(specforge_python()), "-c", READ, str(path), str(max_length)], capture_output=True,
                          text=True, env=env, cwd=tempfile.gettempdir(), check=False, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"SpecForge's reader failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)

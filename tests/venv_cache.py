"""Virtualenvs the tests run other projects' code in, built once under ~/.cache/tokenmill/<name>-<key>/ and reused.

The key hashes what the environment is built from (requirement files, extra pins) and the Python version, so a
changed pin builds a new environment and an unchanged one is reused. A lock makes parallel test workers build it
once; `.ready` is written last, so a build killed halfway is redone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def env_key(*inputs: bytes) -> str:
    digest = hashlib.sha256(b"".join(inputs) + sys.version.encode()).hexdigest()[:12]
    return f"py{sys.version_info.major}{sys.version_info.minor}-{digest}"


def cached_python(name: str, key: str, installs: Sequence[Sequence[str]]) -> Path:
    """The interpreter of `<name>-<key>`, built by running each of `installs` (pip install arguments) in order."""
    target = cache_root() / f"{name}-{key}"
    python = target / "bin" / "python"
    ready = target / ".ready"
    if ready.exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
            for arguments in installs:
                subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                *arguments], check=True)
            ready.write_text(key)
    return python

"""tokenmill's runner. A prompt travels source → render → generate → store, and report/export read what the
store holds; each is a subpackage here, with `spec` (what was asked), `facts` (capacity facts the operator's
planner shares) and `stats` beneath them. The root holds the CLI, the run's start (`prepare`) and progress/metrics.
"""

from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    # The runner image installs the tokenmill-runner distribution; a development checkout installs tokenmill.
    for distribution in ("tokenmill-runner", "tokenmill"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    raise PackageNotFoundError("tokenmill-runner")


__version__ = _version()

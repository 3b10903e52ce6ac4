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

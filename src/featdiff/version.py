"""featdiff's version, as the installed package's metadata states it (pyproject.toml's one
`version`); a leaf module, so anything may import it without importing the package's API."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("featdiff")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"

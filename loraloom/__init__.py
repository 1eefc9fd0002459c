"""loraloom's composition package: the `loraloom` command line, the demo, and the launchers
of the service and the worker pool. It imports every part; no part imports it."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("loraloom")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

"""loraloom's composition package: the `loraloom` command line, the demo, and the launchers
of the service and the worker pool. It imports every part; no part imports it.

Nothing is imported here: the `loraloom` command imports this package before anything else, before
its Ctrl-C guard is installed (`loraloom.commands.startup`), and `importlib.metadata` alone took
0.1-0.3 s, in which a Ctrl-C printed a KeyboardInterrupt traceback. `__version__` is looked up when
it is first asked for (PEP 562).
"""


def __getattr__(name: str) -> str:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("loraloom")
        except PackageNotFoundError:  # running from a source tree that was never installed
            return "0.0.0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

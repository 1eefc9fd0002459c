"""The server began to shut down: what lasts long (a live event stream, up to an hour) ends now.

uvicorn, told to stop (SIGTERM, Ctrl-C), stops accepting connections and waits for every open one
to finish its response before it runs the app's lifespan shutdown: an open event stream held
`loraloom serve` up for as long as its client stayed ("Waiting for connections to close"). The app
hears of the shutdown only through the connections' own `shutdown()` call, which the service's
protocols (app/serving.py) turn into `ShutdownNotice.begin()`; the streams (app/events/router.py)
look at it between polls and end.
"""


class ShutdownNotice:
    """Set once, when the server starts its shutdown (one per app: `app.state.shutdown`).

    A plain flag rather than an event: it is set from uvicorn's event loop and read by streams
    that poll anyway (every SSE_POLL_SECONDS), and it holds no loop (the tests run one app under
    several)."""

    def __init__(self) -> None:
        self._begun = False

    def begin(self) -> None:
        self._begun = True

    @property
    def begun(self) -> bool:
        return self._begun

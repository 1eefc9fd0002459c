"""Start-up freezes the objects it made (app/lifecycle.py `freeze_startup_objects`), so that a
request allocating many containers does not make the collector walk the whole heap each time."""

import gc

from fastapi.testclient import TestClient


def test_the_start_up_heap_is_out_of_the_collectors_view(client: TestClient) -> None:
    # The `client` fixture has run the app's start-up. Modules, routes and schemas are well over
    # 10k objects; without the freeze none is (gc.get_freeze_count() is 0 in a fresh process).
    assert client.get("/healthz").status_code == 200
    assert gc.get_freeze_count() > 10_000

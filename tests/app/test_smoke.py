from fastapi.testclient import TestClient

from app.main import create_app


def test_health_and_ready(settings):
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").status_code == 200
        missing = client.get("/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"

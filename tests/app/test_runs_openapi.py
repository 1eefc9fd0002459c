"""OpenAPI: stable operationIds and tags for generated clients, and a document that resolves."""

from app.config import Settings
from app.main import create_app

EXPECTED = {
    ("post", "/v1/tenants"): ("createTenant", "tenants"),
    ("get", "/v1/tenants"): ("listTenants", "tenants"),
    ("patch", "/v1/tenants/{tenant_id}"): ("updateTenant", "tenants"),
    ("post", "/v1/tenants/{tenant_id}/keys"): ("createApiKey", "tenants"),
    ("delete", "/v1/tenants/{tenant_id}/keys/{key_id}"): ("revokeApiKey", "tenants"),
    ("post", "/v1/runs"): ("createRun", "runs"),
    ("get", "/v1/runs"): ("listRuns", "runs"),
    ("get", "/v1/runs/{run_id}"): ("getRun", "runs"),
    ("post", "/v1/runs/{run_id}/evict"): ("evictRun", "runs"),
    ("delete", "/v1/runs/{run_id}"): ("deleteRun", "runs"),
    ("post", "/v1/runs/{run_id}/heartbeat"): ("runHeartbeat", "runs"),
    ("get", "/healthz"): ("healthz", "health"),
    ("get", "/readyz"): ("readyz", "health"),
}


def _spec() -> dict:
    return create_app(Settings(database_url="sqlite:///:memory:")).openapi()


def test_operation_ids_and_tags():
    spec = _spec()
    for (method, path), (op_id, tag) in EXPECTED.items():
        op = spec["paths"][path][method]
        assert op["operationId"] == op_id
        assert op["tags"] == [tag]
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), "operationIds must be unique"


def test_every_ref_resolves():
    spec = _spec()

    def refs(node):
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    schemas = spec["components"]["schemas"]
    missing = {r for r in refs(spec) if r.removeprefix("#/components/schemas/") not in schemas}
    assert missing == set()


def test_create_run_documents_json_and_toml():
    content = _spec()["paths"]["/v1/runs"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", "application/toml"}
    spec = _spec()
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/RunCreate"}
    schema = spec["components"]["schemas"]["RunCreate"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["config"]["$ref"] == "#/components/schemas/RunConfig"

"""What TOML run bodies cost the service and its other tenants: one tenant posts the costliest TOML
create bodies it can (each refused with a 422), from 8 clients at once, while another tenant lists
its runs. Python's TOML parser is pure Python (and was quadratic in a key's dotted parts: one 64 KiB
body took 50 s of CPU); app/runs/toml_bounds.py checks the text first, and app/runs/schemas.py
parses one body at a time.

    .venv/bin/python -m bench.toml_flood                 # SQLite in a temporary directory
    .venv/bin/python -m bench.toml_flood --database-url postgresql+psycopg://...

Prints each body's time per request (median of 5), then the other tenant's GET /v1/runs latency
idle and under each flood (median and max of 30). The service runs in this process (uvicorn in a
thread, as the tests' LiveServer), so the figures include the clients' own CPU on the same cores.
"""

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from app import migrate
from app.config import Settings
from app.main import create_app
from tests.app.api import LiveServer, TenantHandle, new_tenant
from tests.common import ADMIN_KEY, WORKER_TOKEN

TOML = {"content-type": "application/toml"}
FLOOD_CLIENTS = 8
SAMPLES = 30


def bodies() -> dict[str, bytes]:
    dotted_key = b'name="d"\n[config.metadata]\n' + b"a" + b".a" * 32700 + b"=1\n"  # the prober's
    dotted_header = b'name="d"\n[config.metadata.a' + b".a" * 32697 + b"]\n"
    header = "[h" + ".h" * 63 + "]\n"
    long_keys = "".join("a" + ".a" * 62 + f".k{i}=1\n" for i in range(64))
    many_keys = "".join(f"k{i}=1\n" for i in range(1999 - 64))
    wide = ('name="w"\n' + header + long_keys + many_keys).encode()
    deepest_allowed = b'name="d"\n'
    while len(deepest_allowed) < 65300:  # 64-part array-of-tables headers: the slowest within bounds
        deepest_allowed += b"[[a" + b".a" * 63 + b"]]\nk=1\n"
    return {
        "dotted key, 32,700 parts": dotted_key,
        "dotted table header, 32,700 parts": dotted_header,
        "64-part header over 64 keys of 64 parts": wide,
        "64-part [[array of tables]] headers, 64 KiB (within the bounds)": deepest_allowed,
    }


def latencies(http: httpx.Client, tenant: TenantHandle) -> list[float]:
    out = []
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        assert http.get("/v1/runs", headers=tenant.headers).status_code == 200
        out.append(time.perf_counter() - t0)
    return out


def flooded(url: str, tenant: TenantHandle, body: bytes, measure: Callable[[], list[float]]) -> list[float]:
    """`measure()`'s latencies while FLOOD_CLIENTS clients post `body` as fast as they are answered."""
    stop = threading.Event()

    def flood() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while not stop.is_set():
                http.post("/v1/runs", content=body, headers=tenant.headers | TOML)

    threads = [threading.Thread(target=flood) for _ in range(FLOOD_CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the flood under way
    try:
        return measure()
    finally:
        stop.set()
        for t in threads:
            t.join()


def ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:.1f} ms, max {max(xs) * 1000:.1f} ms"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--database-url", default=None, help="default: SQLite in a temporary directory")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="loraloom-bench-toml-"))
    url = args.database_url or f"sqlite:///{tmp}/db.sqlite"
    migrate.upgrade(url)
    settings = Settings(
        database_url=url, data_dir=tmp / "data", admin_key=ADMIN_KEY, worker_token=WORKER_TOKEN
    )
    with LiveServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=600) as http:
        flooder, other = new_tenant(http, quota=100), new_tenant(http)
        http.post("/v1/runs", json={"name": "x", "config": {}}, headers=other.headers)
        cases = bodies()
        for name, body in cases.items():
            times, status = [], 0
            for _ in range(5):
                t0 = time.perf_counter()
                status = http.post("/v1/runs", content=body, headers=flooder.headers | TOML).status_code
                times.append(time.perf_counter() - t0)
            print(f"{name}: {status}, {statistics.median(times) * 1000:.1f} ms per request")
        print(f"other tenant's GET /v1/runs, idle: {ms(latencies(http, other))}")
        for name in (next(iter(cases)), list(cases)[-1]):
            busy = flooded(server.url, flooder, cases[name], lambda: latencies(http, other))
            print(f"  under {FLOOD_CLIENTS} clients posting '{name}': {ms(busy)}")


if __name__ == "__main__":
    main()

"""The fake loraloom service behind a fault injector, on a real local HTTP server (module-scoped)."""

from collections.abc import Iterator

import pytest

from tests.orchestrator.fake_service import FakeService
from tests.orchestrator.servers import FaultInjector, serve


@pytest.fixture(scope="module")
def service() -> FakeService:
    return FakeService()


@pytest.fixture(scope="module")
def faults(service: FakeService) -> FaultInjector:
    return FaultInjector(service.app)


@pytest.fixture(scope="module")
def base_url(faults: FaultInjector) -> Iterator[str]:
    with serve(faults) as url:
        yield url

"""The Tinker API's per-tenant bounds are operator settings (LORALOOM_…), checked when read."""

import pytest
from pydantic import ValidationError

from app.config import Settings


def test_the_per_tenant_bounds_are_read_from_the_environment_and_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("LORALOOM_TINKER_MAX_PENDING_PER_TENANT", "4096")
    monkeypatch.setenv("LORALOOM_TINKER_MAX_LIVE_SESSIONS_PER_TENANT", "16")
    settings = Settings(data_dir=tmp_path)
    assert (settings.tinker_max_pending_per_tenant, settings.tinker_max_live_sessions_per_tenant) == (
        4096,
        16,
    )

    for name in ("LORALOOM_TINKER_MAX_PENDING_PER_TENANT", "LORALOOM_TINKER_MAX_LIVE_SESSIONS_PER_TENANT"):
        monkeypatch.delenv(name)
    defaults = Settings(data_dir=tmp_path)
    assert (defaults.tinker_max_pending_per_tenant, defaults.tinker_max_live_sessions_per_tenant) == (
        1024,
        256,
    )

    for name in ("LORALOOM_TINKER_MAX_PENDING_PER_TENANT", "LORALOOM_TINKER_MAX_LIVE_SESSIONS_PER_TENANT"):
        monkeypatch.setenv(name, "0")
        with pytest.raises(ValidationError, match=name.removeprefix("LORALOOM_").lower()):
            Settings(data_dir=tmp_path)
        monkeypatch.setenv(name, "8")

"""Start-up and shutdown work: directories, projection rebuild, background sweeper."""

import asyncio
import contextlib

from fastapi import FastAPI

from app.batches.storage import remove_orphan_payloads
from app.config import Settings
from app.projection import rebuild_all
from app.sweeper import run_sweeper
from contracts.durable import remove_stale_temporaries


async def on_startup(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    settings.runs_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(settings.runs_dir)
    with app.state.session_factory() as session:
        rebuild_all(session, settings)
        # Payload files of requests that crashed between the file and the commit: never served, so drop them.
        remove_orphan_payloads(session, settings=settings)
        session.commit()
    app.state.sweeper_task = asyncio.create_task(run_sweeper(app))


async def on_shutdown(app: FastAPI) -> None:
    task: asyncio.Task[None] | None = getattr(app.state, "sweeper_task", None)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""Start-up and shutdown work: directories, projection rebuild, background sweeper."""

from fastapi import FastAPI


async def on_startup(app: FastAPI) -> None:
    settings = app.state.settings
    settings.runs_dir.mkdir(parents=True, exist_ok=True)


async def on_shutdown(app: FastAPI) -> None:
    return None

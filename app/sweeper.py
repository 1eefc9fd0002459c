"""Background sweeper: lease expiry, pool liveness, run heartbeats (stub until the pool work lands)."""

from fastapi import FastAPI


async def run_sweeper(app: FastAPI) -> None:
    return None

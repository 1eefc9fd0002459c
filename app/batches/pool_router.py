"""Worker-facing batch routes: claim, ack, restart-from-checkpoint."""

from fastapi import APIRouter

router = APIRouter(tags=["pool"])

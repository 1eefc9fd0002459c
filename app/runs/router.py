"""HTTP routes for runs (thin: parse, call the service, shape the response)."""

from fastapi import APIRouter

router = APIRouter(tags=["runs"])

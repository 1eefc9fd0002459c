"""HTTP routes for adapters (thin: parse, call the service, shape the response)."""

from fastapi import APIRouter

router = APIRouter(tags=["adapters"])

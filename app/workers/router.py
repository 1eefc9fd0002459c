"""HTTP routes for workers (thin: parse, call the service, shape the response)."""

from fastapi import APIRouter

router = APIRouter(tags=["workers"])

"""HTTP routes for tenants (thin: parse, call the service, shape the response)."""

from fastapi import APIRouter

router = APIRouter(tags=["tenants"])

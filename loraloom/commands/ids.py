"""The ids and steps the CLI puts into URL paths, checked while the arguments are parsed: before
any request, and before `tenants delete` asks for confirmation.

They went into `/v1/runs/{run_id}` as typed: `runs delete ../tenants/ten_...` sent `DELETE
/v1/tenants/ten_...` and deleted a tenant. A bad one is now a usage error naming the argument
(exit 2). The shapes are the service's own (`contracts.ids`); run ids go through the SDK's
`check_run_id`, so the CLI and the SDK refuse the same ones with the same words.
"""

from typing import Annotated

import typer

from contracts.ids import is_issued_id
from orchestrator.client import check_run_id


def _run_id(value: str) -> str:
    try:
        return check_run_id(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _issued(value: str, prefix: str, what: str) -> str:
    if not is_issued_id(value, prefix):  # the SDK's words, for the ids it has no check of
        raise typer.BadParameter(f"not a {what} id: {value!r} (expected {prefix}_ + 12 lowercase hex digits)")
    return value


def _tenant_id(value: str) -> str:
    return _issued(value, "ten", "tenant")


def _key_id(value: str) -> str:
    return _issued(value, "key", "key")


def _step(value: str) -> str:
    # ASCII digits only: str.isdigit() alone takes "²" and other Unicode digits.
    if value == "latest" or (value.isascii() and value.isdigit()):
        return value
    raise typer.BadParameter(f"not a step: {value!r} (expected a step number or 'latest')")


RunIdArg = Annotated[str, typer.Argument(help="The run's id (run_...).", callback=_run_id)]
TenantIdArg = Annotated[str, typer.Argument(help="The tenant's id (ten_...).", callback=_tenant_id)]
KeyIdArg = Annotated[str, typer.Argument(help="The key's id (key_...).", callback=_key_id)]
StepOpt = Annotated[str, typer.Option(help="A step number or 'latest'.", callback=_step)]

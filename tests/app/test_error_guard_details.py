"""The error guard's 422 (a value the database refused, under the routes' own checks) lists its
problem as every 422 does (README "Errors"): it answered `details: []`."""

import json

from sqlalchemy import exc as sa_exc

from app.error_guard import error_response


def test_a_value_the_database_refuses_is_a_422_with_one_problem() -> None:
    refused = sa_exc.DataError("INSERT ...", {}, Exception("value out of range"))
    response = error_response(refused, {"method": "POST", "path": "/v1/runs"}, "req-1")
    assert response.status_code == 422
    error = json.loads(bytes(response.body))["error"]
    assert error["code"] == "validation_error"
    assert error["details"] == [{"loc": ["body"], "msg": error["message"], "type": "value_error"}]

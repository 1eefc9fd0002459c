"""tinker_futures.tokens: what a request costs a pool's round, written at submit, so that the claim
cuts its rounds without loading each dealt request's JSON (one deferred load per row, every poll).

Requests already stored get their count here: a forward_backward's tokens over its data, a sample's
num_samples × (prompt + max_tokens), 0 for the rest (as app.tinker.work.work_tokens; spelt out here
because a migration must not change when the app's code does). A row an old process inserts
afterwards counts 0 tokens; the claim counts such a row's request itself (`work._round_tokens`).

Revision ID: 0012
Revises: 0011
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The count is taken in SQL: a stored request can carry a round's tokens (megabytes of JSON), and
# reading the queue into Python to count it could take gigabytes while the service starts. Being
# SQL, it is also written out by `alembic upgrade --sql`.
POSTGRES_COUNT = """
UPDATE tinker_futures SET tokens =
    COALESCE((SELECT sum(json_array_length(d -> 'tokens'))
              FROM json_array_elements(request -> 'data') AS d), 0)
  + COALESCE((request -> 'sampling' ->> 'num_samples')::int
             * (json_array_length(request -> 'sampling' -> 'prompt')
                + (request -> 'sampling' ->> 'max_tokens')::int), 0)
WHERE request IS NOT NULL AND json_typeof(request) = 'object'
  AND json_typeof(COALESCE(request -> 'data', '[]')) = 'array'
  AND json_typeof(COALESCE(request -> 'sampling', 'null')) IN ('object', 'null')
"""
SQLITE_COUNT = """
UPDATE tinker_futures SET tokens =
    COALESCE((SELECT sum(json_array_length(value, '$.tokens'))
              FROM json_each(tinker_futures.request, '$.data')), 0)
  + COALESCE(json_extract(request, '$.sampling.num_samples')
             * (json_array_length(request, '$.sampling.prompt')
                + json_extract(request, '$.sampling.max_tokens')), 0)
WHERE request IS NOT NULL AND json_type(request) = 'object'
"""


def upgrade() -> None:
    op.add_column(
        "tinker_futures", sa.Column("tokens", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.execute(POSTGRES_COUNT if op.get_context().dialect.name == "postgresql" else SQLITE_COUNT)


def downgrade() -> None:
    with op.batch_alter_table("tinker_futures", schema=None) as batch_op:
        batch_op.drop_column("tokens")

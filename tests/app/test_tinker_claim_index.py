"""The pools' Tinker claims read the claimable futures through their partial index
(app.tinker.models.CLAIMABLE), not every retained future: Postgres uses a partial index only where
the query's filter implies the index's, so a claim filter that drifted from it would scan the table.
Likewise the count of a tenant's live sessions reads the unfinished ones only."""

import pytest
from sqlalchemy import Engine, Select, create_engine, text
from sqlalchemy.dialects.postgresql import asyncpg

from app.db import utcnow
from app.tinker.models import CLAIMABLE
from app.tinker.sampling import base_model_key, base_samples_query
from app.tinker.service import live_sessions_query
from app.tinker.work import claim_query
from bench.tinker_claim import INDEX, seed_retained_futures

pytestmark = pytest.mark.postgres_only

RUNS, DONE_PER_RUN = 10, 2000


@pytest.fixture
def retained_futures(database_url: str):
    """10 active runs, each with 2,000 done futures whose requests were cleared and 2 pending ones, plus
    2,000 done base-model samples and one pending: what a day of Tinker training leaves behind."""
    engine = create_engine(database_url)
    with engine.begin() as conn:
        seed_retained_futures(conn, runs=RUNS, done_per_run=DONE_PER_RUN)
        conn.execute(
            text(
                "INSERT INTO tinker_futures (id, tenant_id, kind, model_id, status, created_at) "
                "SELECT 's' || s, 't', 'sample', :key, CASE WHEN s > :done THEN 'pending' ELSE 'complete' END, "
                "now() FROM generate_series(1, :done + 1) s"
            ),
            {"done": DONE_PER_RUN, "key": base_model_key("base")},
        )
        conn.execute(text("ANALYZE tinker_futures"))
    yield engine
    engine.dispose()


def plan(engine: Engine, query: Select) -> str:
    sql = query.compile(engine, compile_kwargs={"literal_binds": True})
    with engine.connect() as conn:
        return "\n".join(conn.execute(text(f"EXPLAIN {sql}")).scalars())


def test_the_run_work_claim_reads_the_partial_index(retained_futures):
    got = plan(retained_futures, claim_query("pool-1", "base"))
    assert INDEX in got, got
    assert "Seq Scan on tinker_futures" not in got, got


def test_the_base_sample_claim_reads_an_index(retained_futures):
    """Through the partial index or the base model's own futures (model_id), whichever the planner
    costs lower; never the whole table."""
    got = plan(retained_futures, base_samples_query("base"))
    assert "Index" in got and "Seq Scan on tinker_futures" not in got, got


def test_the_claim_reads_the_partial_index_in_a_generic_plan_too(retained_futures):
    """psycopg prepares a statement run often enough, and Postgres may then plan it once for any
    parameters (a generic plan), which cannot look into the bound values of the claim's filter: the
    literal `CLAIMABLE` terms keep the index usable there."""
    compiled = claim_query("pool-1", "base").compile(
        dialect=asyncpg.dialect(), compile_kwargs={"render_postcompile": True}
    )  # $1, $2, … placeholders, as a prepared statement has them
    values = ", ".join(_literal(compiled.params[name]) for name in compiled.positiontup or ())
    with retained_futures.connect() as conn:
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE claim_q AS {compiled}")
        got = "\n".join(conn.exec_driver_sql(f"EXPLAIN EXECUTE claim_q({values})").scalars())
    assert INDEX in got, got
    assert "Seq Scan on tinker_futures" not in got, got


def _literal(value: object) -> str:
    return str(value) if isinstance(value, int) else "'" + str(value).replace("'", "''") + "'"


def test_the_index_holds_only_claimable_futures(retained_futures):
    """Pending work and done work with a kept request: a few rows out of 22,000 retained."""
    with retained_futures.connect() as conn:
        kept = conn.execute(text(f"SELECT count(*) FROM tinker_futures WHERE {CLAIMABLE}")).scalar_one()
    assert kept == RUNS * 2 + 1


def test_the_live_session_count_reads_its_partial_index(database_url: str):
    """A tenant that opened 20,000 sessions and finished them: `create_session`'s count of its live
    ones reads the unfinished ones only."""
    engine = create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO tenants (id, name, max_concurrent_runs, created_at) VALUES ('t', 't', 4, now())"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO tinker_sessions (id, tenant_id, sdk_version, created_at, last_heartbeat_at, "
                    "finished_at) SELECT 'ses' || s, 't', 'x', now(), now(), "
                    "CASE WHEN s > 20000 THEN NULL ELSE now() END FROM generate_series(1, 20003) s"
                )
            )
            conn.execute(text("ANALYZE tinker_sessions"))
        got = plan(engine, live_sessions_query("t", now=utcnow()))
        assert "ix_tinker_sessions_live" in got, got
        with engine.connect() as conn:
            assert conn.execute(live_sessions_query("t", now=utcnow())).scalar_one() == 3
    finally:
        engine.dispose()

"""Command-line options that several benches share, declared once so that they cannot drift apart."""

import argparse
import os

PG_ADMIN_URL_ENV = "LORALOOM_TEST_PG_ADMIN_URL"
DEFAULT_PG_ADMIN_URL = "postgresql+psycopg://root@127.0.0.1:5432/postgres"


def add_pg_admin_url(parser: argparse.ArgumentParser) -> None:
    """`--pg-admin-url`: the Postgres database a bench connects to to create (and drop) its scratch
    database. Its default is the tests' LORALOOM_TEST_PG_ADMIN_URL where that is set (read when the
    parser is built), so benches and tests use the same server."""
    default = os.environ.get(PG_ADMIN_URL_ENV, DEFAULT_PG_ADMIN_URL)
    parser.add_argument(
        "--pg-admin-url", default=default, help=f"default: ${PG_ADMIN_URL_ENV}, else {DEFAULT_PG_ADMIN_URL}"
    )

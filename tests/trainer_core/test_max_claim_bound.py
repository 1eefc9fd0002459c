"""`--max-claim` is held to what one claim may lease (contracts.pool_api.MAX_CLAIM_BATCHES): a pool
started with more sent every claim with it and had each one refused by its own request model (a 422
from the service before that), so it never trained. Now it does not start, naming the setting."""

from typer.testing import CliRunner

from contracts.pool_api import MAX_CLAIM_BATCHES
from loraloom.cli import cli

runner = CliRunner()


def test_a_max_claim_over_a_claims_bound_is_refused_at_start_up(clean_env) -> None:
    env = {**clean_env, "LORALOOM_MAX_CLAIM": str(MAX_CLAIM_BATCHES + 1)}
    result = runner.invoke(cli, ["worker", "--runs-dir", "runs", "--dry-run"], env=env)
    assert result.exit_code == 2, result.output
    assert "LORALOOM_MAX_CLAIM" in result.output and str(MAX_CLAIM_BATCHES) in result.output


def test_the_bound_itself_is_taken(clean_env) -> None:
    env = {**clean_env, "LORALOOM_MAX_CLAIM": str(MAX_CLAIM_BATCHES)}
    result = runner.invoke(cli, ["worker", "--runs-dir", "runs", "--dry-run"], env=env)
    assert result.exit_code == 0, result.output
    assert f'"max_claim": {MAX_CLAIM_BATCHES}' in result.output

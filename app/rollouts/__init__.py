"""Rewards and per-sample metrics that orchestrators send with their rollout batches, aggregated
per rollout step of a run."""

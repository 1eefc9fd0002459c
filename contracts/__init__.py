"""Types every part of loraloom shares, and nothing else: the run config, the wire format of
rollout batches and its one validation, the pool API's bodies, ids, statuses, progress, the
run-directory layout, durable writes, and HTTP errors and retries.

Torch-free and fastapi-free; it imports no other part of the project (a layering test holds it).
"""

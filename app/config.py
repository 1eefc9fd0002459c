"""Service settings, read from LORALOOM_* environment variables."""

from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_RETENTION_SECONDS = 100 * 365 * 86_400.0
"""The longest retention: `now - retention` must stay a date (a larger one raised OverflowError in
every sweep)."""
MIN_RETENTION_SECONDS = {"deleted_run_retention_seconds": 86_400.0, "event_retention_seconds": 3_600.0}
"""The shortest retention other than 0 (never purge), per setting (see each setting for why)."""


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting's error (and its traceback) never shows the secrets.
    model_config = SettingsConfigDict(env_prefix="LORALOOM_", extra="ignore", hide_input_in_errors=True)

    database_url: str = "sqlite:///./.loraloom/loraloom.db"
    """SQLAlchemy URL. Postgres in production (postgresql+psycopg://...), SQLite for the embedded default."""

    data_dir: Path = Path("./.loraloom/data")
    """Artifact store: run directories (rollouts, adapters, checkpoints) live under data_dir/runs/."""

    admin_key: SecretStr | None = None
    """Key for the admin routes (tenants, keys). Unset (or empty): admin routes refuse every request."""

    worker_token: SecretStr | None = None
    """Token the worker pool authenticates with. Unset (or empty): pool routes refuse every request."""

    @field_validator("admin_key", "worker_token", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # `LORALOOM_ADMIN_KEY=` (a compose default, a blank line in .env) means no key: the routes
        # say they are disabled, rather than answering every caller "invalid admin key".
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @model_validator(mode="after")
    def _admin_key_is_not_the_worker_token(self) -> "Settings":
        # Every pool host holds the worker token: were it the admin key, each would be an admin.
        if self.admin_key is not None and self.admin_key == self.worker_token:
            raise ValueError(
                "LORALOOM_ADMIN_KEY and LORALOOM_WORKER_TOKEN are the same secret: every worker pool "
                "host would hold the admin key; give each its own"
            )
        return self

    max_concurrent_runs: int = Field(default=4, ge=1, le=1024)
    """Pool slots: how many runs are active at once (until a pool registers its own count)."""

    runs_wait_for_pool: bool = False
    """True: a run for a base model no live pool serves is created `queued` ("waiting for a pool
    that serves X") and admitted when one registers, so no batch is stored before the pool's
    vocabulary is known. False (the default, DESIGN §10): such runs take one of
    max_concurrent_runs slots at once."""

    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Largest request body accepted; larger bodies get a 413."""

    max_small_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    """Largest body of the routes that carry no bulk data (all but rollout batches, adapter uploads,
    the pool's Tinker results and Tinker's forward_backward and asample: tenants, keys, run configs,
    evictions, the pool's and the Tinker API's other routes, the dashboard's forms); larger bodies
    get a 413. Checked before authentication, like `max_body_bytes` (app/request_guard.py)."""

    body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """A request body must arrive whole within this many seconds of the headers, else 408.
    Bodies are read before any database work, so a slow client holds a socket, not a connection."""

    header_timeout_seconds: float = Field(default=15.0, gt=0, le=3600)
    """A request's line and headers must arrive whole within this many seconds, else 408 (nothing
    arrived yet: the connection is closed without an answer). Counted from the connection's opening,
    and on a kept-alive connection from the next request's first byte (until then the connection is
    idle: closed after the keep-alive timeout, 5 s). Headers sent in part and then left held a
    connection for ever (enough of them use up the service's file descriptors)."""

    shutdown_timeout_seconds: int = Field(default=10, ge=1, le=3600)
    """On SIGTERM or Ctrl-C the server stops accepting connections and gives the requests in flight
    this long to finish, then cancels them and exits (uvicorn's `timeout_graceful_shutdown`; read
    by the server, app/serving.py). Live event streams end at once. Whole seconds (uvicorn's
    command-line option is an integer)."""

    max_buffered_body_bytes: int = Field(default=512 * 1024 * 1024, ge=1024)
    """Request-body bytes the service holds at once while bodies are arriving (per service process;
    a body stops counting once it arrived whole, or when its request ends). A body that would take
    the total past it gets a 503 + Retry-After; a body alone is always taken (up to its route's
    limit), so the bound is this or one `max_body_bytes` body, whichever is larger."""

    tenant_max_buffered_body_bytes: int | None = Field(default=None, ge=1024)
    """Of `max_buffered_body_bytes`, what one tenant's bodies may hold at once while they arrive
    (bodies whose tenant the request guard knows before reading them: the bulk routes of the
    tenants and the Tinker API); past it that tenant's body gets a 429 + Retry-After, so one tenant
    cannot fill the budget and make every other tenant's upload a 503. None: half the budget
    (256 MiB, four `max_body_bytes` bodies at the defaults). A tenant's one body is always taken."""

    tenant_max_in_flight: int = Field(default=16, ge=1, le=100_000)
    """Requests of one tenant handled at once (per service process); more get a 429 + Retry-After."""

    tenant_max_event_streams: int = Field(default=16, ge=1, le=100_000)
    """Live event streams (SSE, API and dashboard) one tenant may hold open at once (per service
    process); the next gets a 429 + Retry-After."""

    tenant_max_adapters: int = Field(default=64, ge=1, le=100_000)
    """Uploaded adapters (POST /v1/adapters) one tenant may keep; another upload is a 409
    `adapter_quota` until one is deleted. Each is kept on disk twice (its files and a tar.gz)."""

    tenant_max_adapter_bytes: int = Field(default=4 * 1024**3, ge=1024 * 1024)
    """Bytes on disk one tenant's uploaded adapters may take together (each adapter's files and its
    tar.gz, as written); an upload past it is a 409 `adapter_quota` until one is deleted.
    `tenant_max_adapters` alone let a tenant keep 64 uploads of `max_body_bytes` each, twice."""

    tenant_max_queued_runs: int = Field(default=64, ge=1, le=100_000)
    """Runs one tenant may have waiting (`queued`) at once; creating another gets a 429 + Retry-After.
    Every admission walks the queue under the service-wide admission lock, so an unbounded one let a
    tenant slow every other tenant's run creation."""

    run_adapters_kept: int = Field(default=64, ge=0, le=10_000_000)
    """Step adapters (the PEFT directory the trainer publishes at each step, GET /v1/runs/{id}/adapters)
    one run keeps: its newest this many, by step and by publication (the newest always; a run whose
    steps went back keeps what it published last too). The sweeper deletes older ones, row and
    files, except a step a queued or active run starts from (`init_from`) or a live Tinker sampler
    checkpoint names (app/adapters/pruning.py); a download of a deleted step is a 404 that says it was
    pruned. 0: keep all (every step's adapter stays on disk until its run is deleted)."""

    run_max_pending_batches: int = Field(default=1024, ge=1, le=10_000_000)
    """Unclaimed batches one run may hold; a submission past it gets a 429 + Retry-After."""

    run_max_pending_bytes: int = Field(default=1024**3, ge=1024)
    """Payload bytes of one run's unclaimed batches; a submission past it gets a 429 + Retry-After."""

    lease_seconds: float = Field(default=120.0, gt=0)
    """How long a worker's claim on rollout batches lasts before they return to pending."""

    pool_timeout_seconds: float = Field(default=60.0, gt=0)
    """A pool silent for longer than this is declared dead and its leased batches return to pending."""

    sweep_interval_seconds: float = Field(default=2.0, gt=0)
    """How often the background sweeper checks leases, pool liveness and run heartbeats."""

    housekeeping_interval_seconds: float = Field(default=30.0, gt=0)
    """How often the sweeper also runs its housekeeping: the retention purges, the dashboard
    sessions' and done Tinker futures' purges, the adapter pruning and the reconcile pass. Their
    deadlines are hours and days, so running them at every sweep only burned CPU (half of an idle
    service's); a sweep that left a backlog (a bounded chunk each time) is followed by another at
    the next sweep."""

    tinker_future_ttl_seconds: float = Field(default=86_400.0, ge=0)
    """How long the sweeper keeps a done Tinker future (its result, for retrieve_future); after that
    retrieve_future answers 404. The records of models and saved weights are kept as long as their
    run (a deleted run's go with it, deleted_run_retention_seconds after the deletion)."""

    deleted_run_retention_seconds: float = Field(default=604_800.0, ge=0, le=MAX_RETENTION_SECONDS)
    """How long the row of a deleted run is kept after its deletion (GET answers it `deleted`, an
    Idempotency-Key sent again replays it); then the sweeper deletes it with every row about the run
    (batches, adapters, metrics, checkpoints, rollout stats, events, Tinker models and futures).
    0: never (the runs table then grows by every run ever created). At least a day otherwise: a
    create retried with its Idempotency-Key after the purge makes a new run (app/retention.py)."""

    event_retention_seconds: float = Field(default=2_592_000.0, ge=0, le=MAX_RETENTION_SECONDS)
    """How long the sweeper keeps an event (the audit log, the run feeds); older ones are deleted, and
    a feed cursor or Last-Event-ID naming one goes on from the next event kept. 0: never. At least an
    hour otherwise: a live stream or a paging client a little behind must not lose events."""

    @field_validator("deleted_run_retention_seconds", "event_retention_seconds")
    @classmethod
    def _zero_or_at_least(cls, value: float, info: ValidationInfo) -> float:
        least = MIN_RETENTION_SECONDS[info.field_name or ""]
        if 0 < value < least:
            raise ValueError(f"must be 0 (keep for ever) or at least {least:g} seconds")
        return value

    tinker_base_sample_wait_seconds: float = Field(default=600.0, gt=0)
    """How long a base-model `sample` request waits for a pool of its base model to claim it; the
    sweeper fails it after that (a live pool claims one within about a second)."""

    tinker_max_tokens_per_round: int = Field(default=262_144, ge=1024, le=16 * 1024 * 1024)
    """Tokens of Tinker work one pool round takes (forward/forward_backward data, and a run's samples
    as num_samples x (prompt + max_tokens); at least one request): a request that does not fit
    leaves its run for the next round while the claim goes on with the others. One request may
    carry at most this many tokens (one datum alone up to the pool's max_seq_len; a sample its
    num_samples x (prompt + max_tokens)) and 1,024 datums; the Tinker SDK is told both (its client config) and chunks its requests to fit. Base-
    model samples have a budget of their own of this size (`app.tinker.sampling.claim_base_samples`)."""

    tinker_max_pending_per_tenant: int = Field(default=1024, ge=1, le=1_000_000)
    """Tinker requests (training work and samples) of one tenant waiting for a pool at once; one more
    is a 429 with Retry-After (the SDK retries it). The SDK sends up to 400 samples at once; without a
    bound one tenant could queue hours of work ahead of everyone."""

    tinker_max_pending_bytes_per_tenant: int = Field(default=1024**3, ge=1024 * 1024)
    """Bytes of stored request JSON of one tenant's Tinker work not yet done (pending or running);
    a request past it is a 429 with Retry-After, like the count above, and is not stored (a request
    alone is always taken when nothing of the tenant's waits). The count alone let a tenant queue
    1,024 requests of up to ~15 MB of JSON each (a round's tokens, as JSON numbers)."""

    tinker_max_live_sessions_per_tenant: int = Field(default=256, ge=1, le=1_000_000)
    """Tinker sessions of one tenant live at once (each SDK ServiceClient opens one; finished ones and
    ones silent for 5 minutes do not count): past it `create_session` is a 429, so a tenant cannot
    add session rows as fast as it can send requests."""

    tinker_max_long_polls_per_tenant: int = Field(default=64, ge=1, le=100_000)
    """`retrieve_future` long polls of one tenant checking their futures at once (per service
    process); more wait in line for a place on the event loop (no thread, no query) and answer "try
    again" if none comes up in 10 s; past `tinker_max_pending_per_tenant` waiting, one more is a 429.
    Each check of a poll also holds one of the tenant's `tenant_max_in_flight` places while it runs
    (app/tinker/router.py, app/tinker/long_polls.py)."""

    tinker_max_saves_per_tenant: int = Field(default=100, ge=1, le=1_000_000)
    """Training states (`save_state` / save_weights names) one tenant keeps at once, over all its
    models whose runs are not deleted, pending saves included: each is adapter + optimizer state on
    the pool's disk. Past it, a save under a new name is a 403 `save_quota` and nothing is stored;
    saving a kept name again overwrites it. A deleted checkpoint still counts (the pool keeps its
    state until the run is deleted), and its name may be saved again."""

    tinker_max_sampler_checkpoints_per_tenant: int = Field(default=256, ge=1, le=1_000_000)
    """Live sampler checkpoints (`save_weights_for_sampler` names) one tenant keeps at once, over all
    its models whose runs are not deleted, pending saves included: each pins its adapter step from
    the pruning (`run_adapters_kept`) and has a copy on the pool's disk. Past it, a save under a new
    name is a 403 `save_quota` and nothing is stored; saving a kept name again replaces it. Deleting
    a sampler checkpoint (DELETE /api/v1/training_runs/{id}/checkpoints/sampler_weights/{name})
    frees its place."""

    tinker_session_retention_seconds: float = Field(default=86_400.0, ge=0, le=MAX_RETENTION_SECONDS)
    """Finished Tinker sessions (and ones without a heartbeat this long) that own no model, and
    sampling sessions of runs that left, are deleted this long after (0: kept for ever;
    `app.tinker.service.purge_finished_sessions`)."""

    tinker_session_timeout_seconds: float = Field(default=600.0, ge=60, le=MAX_RETENTION_SECONDS)
    """A Tinker model whose session has sent no heartbeat this long (the SDK sends one every 10 s
    while its process lives; a closed ServiceClient sends none) is evicted by the sweeper, its
    quota place freed: always while its run is queued, and while active unless it has a live sampler
    checkpoint (`app.tinker.abandoned`). At least 60 s: a few missed heartbeats are not a dead process."""

    ui_login_max_failures: int = Field(default=10, ge=1, le=1_000)
    """Failed dashboard sign-ins one client address may make within `ui_login_window_seconds` (per
    service process); past it the sign-in page answers 429 + Retry-After without checking the key
    (app/ui/login_limits.py says which address counts behind a proxy)."""

    ui_login_window_seconds: float = Field(default=300.0, gt=0, le=86_400)
    """The sliding window of `ui_login_max_failures`."""

    metrics_token: SecretStr | None = None
    """Bearer token required on GET /metrics. Unset: /metrics is open (keep it off the public network)."""

    metrics_cache_seconds: float = Field(default=5.0, ge=0, le=60)
    """How long GET /metrics serves the figures it read from the database (runs, batches, steps,
    slots, pools) before it reads them again (per service process); one reading at a time, and a
    scrape that comes meanwhile gets the previous figures (with several workers, waits for the new
    ones). Each reading is a dozen counting queries over the runs, batches and step tables, so
    scrapes cost the database at most one reading per this many seconds however many clients
    scrape. 0: read at every scrape that does not overlap one under way. The page is rendered at
    most once a second, so request counts and latencies are up to a second old."""

    api_key_cache_seconds: float = Field(default=2.0, ge=0, le=60)
    """How long a process trusts an API key it looked up (0: look up on every request). A key revoked
    in another process (or replica) stops working within this bound; in the revoking process, at once."""

    api_key_miss_cache_seconds: float = Field(default=1.0, ge=0, le=10)
    """How long a process remembers that an API key is unknown or revoked (0: never), so a client
    repeating a wrong key costs no database lookup per request. Keys are made by the service, at
    random, so a new key is never one of these; only a key written into the database by hand after
    a client tried it works this much later."""

    ingest_run_cache_seconds: float = Field(default=2.0, ge=0, le=60)
    """How long the batch route trusts an active run's config and its pool's vocabulary as it read
    them (0: read them with every batch). The run's state and step are checked again under its row
    lock with every batch, so an evicted or finished run takes no batch either way; within this bound
    a batch for a run that just left may be checked (422) before it is refused (409), and a pool that
    re-registers its base model with another vocabulary is seen by this process this much later."""

    @property
    def runs_dir(self) -> Path:
        return self.data_dir / "runs"


@lru_cache
def get_settings() -> Settings:
    return Settings()

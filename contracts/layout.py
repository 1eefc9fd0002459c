"""Names on disk shared by the service's projection, the pool and the SDK.

A run directory, in the layout of the source documents:

    {runs_dir}/run_xxx/
    ├── control/orch.toml                    the run config as TOML
    ├── control/evicted.txt                  the eviction reason, once evicted
    ├── control/config_validation_error.txt  why the config was rejected
    ├── rollouts/step_N/                     rollout batches
    ├── broadcast/step_N/                    adapters (PEFT files, then a STABLE marker)
    └── checkpoints/step_N/                  trainer checkpoints
"""

from contracts.pool_api import INT32_MAX

CONTROL_DIR = "control"
ORCH_CONFIG_FILE = "orch.toml"
EVICTED_FILE = "evicted.txt"
CONFIG_ERROR_FILE = "config_validation_error.txt"
ROLLOUTS_DIR = "rollouts"
BROADCAST_DIR = "broadcast"
CHECKPOINTS_DIR = "checkpoints"
STABLE_MARKER = "STABLE"
"""Written last into a step directory: its presence means every other file is complete."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
"""A PEFT adapter directory holds exactly these two files."""


_STEP_PREFIX = "step_"


def step_dir_name(step: int) -> str:
    return f"{_STEP_PREFIX}{step}"


def step_of_dir_name(name: str) -> int | None:
    """The step a directory named by `step_dir_name` holds; None for any other name, `step_007` or
    a step past INT32_MAX (a step's bound on the wire and in the database) too: none of ours."""
    digits = name.removeprefix(_STEP_PREFIX)
    if digits == name or not (digits.isascii() and digits.isdigit()) or len(digits) > len(str(INT32_MAX)):
        return None
    step = int(digits)
    return step if step <= INT32_MAX and step_dir_name(step) == name else None

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


def step_dir_name(step: int) -> str:
    return f"step_{step}"

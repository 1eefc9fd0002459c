"""Helpers for the end-to-end tests: synthetic rollout batches, a worker pool process,
waiting on runs, and reading adapters back."""

import io
import os
import random
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
from safetensors.torch import load as load_safetensors

from contracts.tokenizer import CharTokenizer
from loraloom.launch import launch_pool
from tests.common import WORKER_TOKEN

TOKENIZER = CharTokenizer()

MODEL_CACHE = Path(
    os.environ.get("LORALOOM_MODEL_CACHE", Path(__file__).resolve().parents[2] / ".loraloom" / "models")
)

TORCHRUN_PICKS_THE_PORT = {"LORALOOM_MASTER_PORT": "0"}
"""Environment for a `loraloom worker` of several ranks: `--master-port 0`, a rendezvous on a port
torchrun binds itself (`--standalone`). A port the test picked free and passed could be taken by the
other xdist worker before torchrun bound it. (`launch_pool(master_port=0)` asks for the same.)"""


def synthetic_batch(
    seed: int, *, n_samples: int, rollout_step: int = 0, advantage_scale: float = 1.0
) -> dict:
    """A TrainingBatch as JSON: random prompts and completions inside the tiny model's vocabulary."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n_samples):
        prompt = [TOKENIZER.bos_token_id] + [
            rng.randrange(4, TOKENIZER.vocab_size) for _ in range(rng.randint(3, 8))
        ]
        completion = [rng.randrange(4, TOKENIZER.vocab_size) for _ in range(rng.randint(2, 6))]
        examples.append(
            {
                "prompt_ids": prompt,
                "prompt_mask": [False] * len(prompt),
                "completion_ids": completion,
                "completion_mask": [True] * len(completion),
                "completion_logprobs": [-rng.uniform(4.0, 4.8) for _ in completion],  # near ln(vocab)
                "advantage": rng.choice([-1.0, 1.0]) * advantage_scale,
            }
        )
    return {"examples": examples, "temperature": 1.0, "step": rollout_step}


def assert_trained_alike(got: dict, want: dict, *, rel: float = 2e-2) -> None:
    """Two adapters of runs trained on the same samples, one beside other runs' samples in the same
    packed micro-batches (the isolation tests), are equal up to rounding: every tensor within `rel` of
    its norm. Not elementwise: the shared micro-batches run the matmuls at other shapes, which sum in
    another order on some CPUs (1e-6 of a gradient norm at step 1 on an AMD EPYC instance, 0 on
    others), and Adam, normalising each coordinate's gradient, turns that into up to ~3e-3 on a single
    weight of a coordinate whose gradient is near its eps within a few steps (lr 5e-3). Measured there:
    every tensor within 3.0e-3 of its norm after six steps. A leak of the other runs' samples changes a
    step's whole gradient: tens of percent."""
    assert got.keys() == want.keys()
    for key in want:
        apart = float((got[key] - want[key]).norm() / want[key].norm())
        assert apart < rel, (key, apart)


def run_config(**overrides) -> dict:
    config = {
        "base_model": "loraloom-tiny",
        "lora": {"rank": 4, "alpha": 8.0},
        "optim": {"lr": 5e-3},
        "batch_size": 4,
        "max_steps": 3,
        "seq_len": 64,
        "max_async_level": 1000,
        "ckpt": {"interval": 1, "keep_last": 3},
        # Synthetic completions are far from what the model would sample: keep every token in the loss.
        "loss": {"mask_ratio_low": 1e-30, "mask_ratio_high": 1000.0},
    }
    config.update(overrides)
    return config


def start_pool(
    url: str,
    *,
    data_dir: Path,
    nproc: int = 2,
    slots: int = 2,
    exit_when_idle: float | None = None,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """The pool under torchrun, in its own process group; the worker token travels in the
    environment (never on a command line, which `ps` shows)."""
    args = [
        "--url",
        url,
        "--slots",
        str(slots),
        "--seq-len",
        "64",
        "--max-rank",
        "8",
        "--checkpoint-dir",
        str(data_dir / "runs"),
        "--model-cache-dir",
        str(MODEL_CACHE),
        "--pack-timeout",
        "0.5",
        "--poll-interval",
        "0.1",
    ]
    if exit_when_idle is not None:
        args += ["--exit-when-idle", str(exit_when_idle)]
    process = launch_pool(
        nproc_per_node=nproc,
        worker_args=args,
        master_port=0,  # torchrun binds a free one itself (a port picked here could be taken first)
        env={
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "LORALOOM_WORKER_TOKEN": WORKER_TOKEN,
            **(env or {}),
        },
        log_path=log_path,
    )
    return process


def kill_pool(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
    process.wait(timeout=60)


def wait_for(predicate, *, timeout: float, interval: float = 0.3, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def run_status(client: httpx.Client, run_id: str) -> dict:
    response = client.get(f"/v1/runs/{run_id}")
    response.raise_for_status()
    return response.json()


def download_adapter_tensors(client: httpx.Client, run_id: str, step: int | str = "latest") -> dict:
    response = client.get(f"/v1/runs/{run_id}/adapters/{step}/files/adapter_model.safetensors")
    response.raise_for_status()
    return load_safetensors(response.content)


def extract_adapter(client: httpx.Client, run_id: str, step: int | str, dest: Path) -> Path:
    response = client.get(f"/v1/runs/{run_id}/adapters/{step}")
    response.raise_for_status()
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
    return dest

"""Experiment trackers for the rollout loop: `RolloutLoop(..., loggers=[TensorBoardLogger(dir)])`.

Each iteration the loop hands its loggers the rewards it measured (mean reward and success rate
per agent), the validation results when it validated, and the trainer's figures fetched from the
service for every step trained since the last iteration (loss, entropy, KL, grad norm, lr, tokens,
and the service's reward aggregates per step). Optional extras: `pip install loraloom[tensorboard]`,
`loraloom[wandb]`; each logger imports its library only when made.
"""

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol


class TrackerLogger(Protocol):
    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Record `scalars` (name → value) at `step`; non-finite values are skipped."""

    def close(self) -> None:
        """Flush and release; the loop calls it when it ends."""


def finite(scalars: Mapping[str, float | int | None]) -> dict[str, float]:
    return {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(float(v))}


class TensorBoardLogger:
    """Event files under `log_dir`, through torch's SummaryWriter (the `tensorboard` package's
    own writer when torch is not installed)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        except ImportError:
            try:
                from tensorboard.summary import Writer  # type: ignore[import-untyped]
            except ImportError as exc:
                raise ImportError("TensorBoardLogger needs `pip install loraloom[tensorboard]`") from exc
            self._writer = Writer(str(self.log_dir))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for name, value in finite(scalars).items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run. `mode="offline"` writes the run under `dir` for a later `wandb sync`
    (nothing leaves the machine); "online" needs WANDB_API_KEY."""

    def __init__(
        self,
        project: str,
        *,
        name: str | None = None,
        dir: str | Path | None = None,  # noqa: A002 - wandb's own name for it
        mode: Literal["online", "offline", "disabled"] = "online",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("WandbLogger needs `pip install loraloom[wandb]`") from exc
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(dir) if dir is not None else None,
            mode=mode,
            config=dict(config or {}),
            reinit="create_new",
        )

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        values: dict[str, Any] = dict(finite(scalars))
        values["step"] = step  # the x axis; W&B's own _step counts log() calls
        self.run.log(values)

    def close(self) -> None:
        self.run.finish()

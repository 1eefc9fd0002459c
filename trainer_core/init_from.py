"""A run's starting weights from `init_from` (DESIGN §3), loaded when the pool admits a run that has no
checkpoint of its own yet:

- an adapter (`{run_id, step}`): the master downloads it from the source (the service serves the
  adapter's tar.gz) and every rank loads the same tensors (broadcast);
- a checkpoint (`{run_id, checkpoint, with_optimizer}`): every rank reads the source run's checkpoint
  from the pool's checkpoint directory (the pool that trained the source run wrote it there), its
  adapter and value head, and with `with_optimizer` its optimizer and schedule state, so training goes
  on exactly as the source run's would have.

A run's own checkpoint always wins: after a restart it resumes from its own weights.
"""

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.http import ApiError
from contracts.layout import step_dir_name
from contracts.pool_api import InitFrom
from contracts.run_config import RunConfig
from trainer_core.checkpoint import latest_checkpoint, load_checkpoint
from trainer_core.dist import World, broadcast_from_master
from trainer_core.export import import_peft_adapter
from trainer_core.lora import MultiLoRA
from trainer_core.publish import checkpoint_root
from trainer_core.runs import RunSource


@dataclass
class InitialWeights:
    """What `load_initial_weights` loaded beyond the adapter (already in the slot)."""

    optimizer_state: dict[str, Any] | None = None
    """`MultiRunOptimizer.state_dict` to load once the run's optimizer exists (with_optimizer)."""
    value_head: dict[str, Any] | None = None
    """The source checkpoint's value head, for a GAE run."""
    error: str | None = None
    """Why the weights could not be loaded (the run is then evicted); None when all went well."""


def load_initial_weights(
    *,
    lora: MultiLoRA,
    slot: int,
    run_id: str,
    config: RunConfig,
    checkpoint_home: Path,
    source: RunSource | None,
    world: World,
) -> InitialWeights:
    """Load the run's `init_from` weights into `slot` (configured for `config` and reset beforehand).
    Called on every rank; `source` is the master's (None on the others)."""
    if latest_checkpoint(checkpoint_root(checkpoint_home, run_id)) is not None:
        return InitialWeights()  # resuming: restore_slot loads the run's own checkpoint
    shared: dict[str, Any] = {"spec": None, "state": None, "error": None}
    if source is not None:
        try:
            spec = source.init_from(run_id)
            shared["spec"] = spec.model_dump() if spec is not None else None
            if spec is not None and spec.checkpoint is None:
                with tempfile.TemporaryDirectory(prefix=f"{run_id}-init-") as tmp:
                    if source.fetch_init_adapter(run_id, Path(tmp)):
                        import_peft_adapter(lora, slot, tmp, target_modules=config.lora.target_modules)
                        shared["state"] = lora.slot_state_dict(slot)
        except (ValueError, KeyError, OSError, ApiError) as exc:
            shared["error"] = _reason(exc, (checkpoint_home, Path(tempfile.gettempdir())))
    shared = broadcast_from_master(shared, world)
    # The run's own dropout (its rank and alpha are the source's: the service checked them), and its
    # own modules: without them every module the pool wraps was enabled again for every fresh run,
    # undoing admit_slot's mask (a run asking for q_proj, v_proj trained and exported all of them).
    lora.configure_slot(
        slot,
        rank=config.lora.rank,
        alpha=config.lora.alpha,
        dropout=config.lora.dropout,
        target_modules=config.lora.target_modules,
    )
    out = InitialWeights(error=shared["error"])
    if shared["state"] is not None and source is None:
        lora.load_slot_state_dict(slot, shared["state"])
    spec = InitFrom.model_validate(shared["spec"]) if shared["spec"] is not None else None
    if spec is not None and spec.checkpoint is not None and spec.run_id is not None and out.error is None:
        path = checkpoint_root(checkpoint_home, spec.run_id) / step_dir_name(spec.checkpoint)
        try:
            ckpt = load_checkpoint(path)
            lora.load_slot_state_dict(slot, ckpt.adapter)
        except (OSError, ValueError, KeyError) as exc:
            out.error = (
                f"checkpoint {spec.checkpoint} of run {spec.run_id}: {_reason(exc, (checkpoint_home,))}"
            )
            return out
        if spec.with_optimizer:
            out.optimizer_state = ckpt.optimizer_state
        if ckpt.extra is not None:
            out.value_head = ckpt.extra.get("value_head")
    return out


def _reason(exc: BaseException, roots: tuple[Path, ...]) -> str:
    """`exc` as the run's eviction reason, each path under one of the pool's directories (`roots`:
    its checkpoint home, the temporary directory an adapter is imported from) cut to its last part
    (`step_4`, `adapter_model.safetensors`): the reason reaches the tenant (GET /v1/runs/{id}), the
    pool's directories do not concern them. Only those roots: anything else that looks like a path
    (an API route in a RetryExhausted, `GET /v1/pool/runs/...`) is the tenant's to read."""
    message = str(exc)
    for root in roots:
        for spelling in {str(root), str(root.resolve())}:
            # The root whole (not /tmp in /tmpfoo nor in /var/tmp), then the rest of the path up to a
            # quote or a space.
            under = re.compile(
                r"(?<![^\s'\"=(])" + re.escape(spelling.rstrip("/")) + r"(?:/[^\s'\":]*)?(?![^/\s'\":])"
            )
            message = under.sub(lambda m: m.group(0).rstrip("/").rpartition("/")[2], message)
    return f"{type(exc).__name__}: {message}"


def module_shapes(lora: MultiLoRA) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adapted module type (q_proj, ...), for the service to check
    uploaded adapters against; the pool registers it."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, layer in lora.layers.items():
        shapes.setdefault(name.rsplit(".", 1)[-1], (layer.in_features, layer.out_features))
    return shapes

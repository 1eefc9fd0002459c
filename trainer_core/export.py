"""One slot ↔ a standard PEFT LoRA adapter directory (what `peft` and vLLM load as they are).

    adapter_config.json          {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ..., ...}
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight  (r, in)
                                 base_model.model.<module>.lora_B.weight  (out, r)

<module> is the wrapped layer's qualified name in the Hugging Face model, e.g.
"model.layers.0.self_attn.q_proj": PEFT wraps the causal LM in `base_model.model`. PEFT scales
the delta by lora_alpha / r, as `MultiLoRALinear` does, so the adapter carries the slot's rank
and alpha unchanged.
"""

import gzip
import io
import json
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from contracts.durable import follow_umask, fsync_path
from contracts.layout import ADAPTER_CONFIG, ADAPTER_FILES, ADAPTER_WEIGHTS
from contracts.peft import PEFT_PREFIX, adapter_problems, split_factor
from contracts.tar_headers import TarHeaderProblem, check_tar_headers
from trainer_core.lora import MultiLoRA
from trainer_core.models.precision import parse_dtype


def peft_adapter_config(handle: MultiLoRA, slot: int, *, base_model_name_or_path: str) -> dict[str, Any]:
    """The adapter_config.json of `slot`: a plain LoRA (no DoRA/rsLoRA/bias/extra modules)."""
    cfg = handle.slot_config(slot)
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        # An integral alpha is written as an int, as peft itself writes it.
        "lora_alpha": int(cfg.alpha) if cfg.alpha.is_integer() else cfg.alpha,
        "lora_dropout": cfg.dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": cfg.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(handle.slot_target_modules(slot)),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def peft_state_dict(
    handle: MultiLoRA, slot: int, *, dtype: torch.dtype | str | None = torch.float32
) -> dict[str, Tensor]:
    """The slot's tensors under PEFT key names, on the CPU, contiguous, in ``dtype``.

    ``dtype``: fp32 by default (exact: the trainer's master weights are fp32), ``"bf16"``/``"fp16"`` (or a
    torch dtype) on request, ``None`` for the parameters' own dtype.
    """
    target = None if dtype is None else parse_dtype(dtype)
    out: dict[str, Tensor] = {}
    for key, tensor in handle.slot_state_dict(slot).items():
        module, _, factor = key.rpartition(".")
        out[f"{PEFT_PREFIX}{module}.{factor}.weight"] = tensor.to(
            device="cpu", dtype=target or tensor.dtype
        ).contiguous()
    return out


def export_peft_adapter(
    handle: MultiLoRA,
    slot: int,
    out_dir: str | os.PathLike[str],
    *,
    base_model_name_or_path: str,
    dtype: torch.dtype | str | None = torch.float32,
    overwrite: bool = False,
) -> Path:
    """Write `slot` as a PEFT adapter directory at `out_dir`, atomically; returns its path.

    The tensors are written in ``dtype`` (see `peft_state_dict`: fp32 unless asked otherwise).

    The files are written to a temporary directory next to `out_dir`, flushed to disk, then
    renamed into place, so a reader sees either no directory or a complete one. An existing
    `out_dir` is an error unless `overwrite` (then it is swapped out and removed: the only
    window in which `out_dir` is absent is between two renames).
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = peft_adapter_config(handle, slot, base_model_name_or_path=base_model_name_or_path)
    tensors = peft_state_dict(handle, slot, dtype=dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        follow_umask(tmp / ADAPTER_WEIGHTS)  # not safetensors' 0600
        for name in ADAPTER_FILES:
            fsync_path(tmp / name)
        follow_umask(tmp)  # it becomes `out`: not mkdtemp's 0700; widened once its files are in
        fsync_path(tmp)
        _replace_dir(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def import_peft_adapter(
    handle: MultiLoRA,
    slot: int,
    adapter_dir: str | os.PathLike[str],
    *,
    strict: bool = True,
    target_modules: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Load a PEFT LoRA adapter directory into `slot` (warm start, resume); configures the slot,
    for `target_modules` (the run's; None: every module the handle wraps).

    Returns {"rank", "alpha", "dropout", "target_modules", "base_model_name_or_path"}. Errors on
    adapter features a slot cannot represent (DoRA, rsLoRA, per-module ranks, bias, extra
    modules), rank above max_rank, tensors named otherwise than PEFT names them, modules the handle
    does not wrap, dtypes that are not floating point, wrong shapes (the rules of contracts/peft.py,
    which the service also checks an uploaded adapter by), and — when
    `strict` — on modules of the slot the adapter lacks (with `strict=False` those start as a
    fresh adapter in this slot: A Kaiming-uniform, B = 0, a zero delta that can still learn). Nothing is changed unless every check passes.
    """
    path = Path(adapter_dir)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    # The rules the service also checks an uploaded adapter by (contracts/peft.py), here against the
    # layers this model wraps; only the wrapped modules the adapter lacks (`strict`) are left.
    wrapped = {name: (layer.in_features, layer.out_features) for name, layer in handle.layers.items()}

    def dims(module: str) -> tuple[int, int] | str:
        return wrapped.get(module) or f"this model does not wrap {module!r} with LoRA"

    header = _safetensors_header(path / ADAPTER_WEIGHTS)
    problems = adapter_problems(config, header, max_rank=handle.max_rank, dims=dims)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"{path}: " + "; ".join(p.message for p in problems[:5]) + more)
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    dropout = float(config.get("lora_dropout", 0.0))
    by_module: dict[str, dict[str, Tensor]] = {}
    for key, tensor in load_file(path / ADAPTER_WEIGHTS).items():
        split = split_factor(key)
        assert split is not None  # every name was checked above
        by_module.setdefault(split[0], {})[split[1]] = tensor
    # The slot's layers: a run that adapts only some of the wrapped modules imports only those.
    wanted = handle.target_modules if target_modules is None else tuple(target_modules)
    layers = {name: layer for name, layer in handle.layers.items() if name.rpartition(".")[2] in wanted}
    if outside := sorted(by_module.keys() - layers.keys()):
        raise ValueError(f"{path}: adapter adapts modules outside the run's target_modules: {outside[:5]}")
    missing = sorted(layers.keys() - by_module.keys())
    if missing and strict:
        raise ValueError(
            f"{path}: adapter lacks wrapped modules {missing[:5]} (pass strict=False to start them fresh)"
        )
    state: dict[str, Tensor] = {}
    for name, layer in layers.items():
        factors = by_module.get(name)
        if factors is None:
            a, b = torch.zeros(rank, layer.in_features), torch.zeros(layer.out_features, rank)
        else:
            a, b = factors["lora_A"], factors["lora_B"]
        if tuple(a.shape) != (rank, layer.in_features) or tuple(b.shape) != (layer.out_features, rank):
            raise ValueError(
                f"{path}: {name} expects lora_A {(rank, layer.in_features)} and lora_B "
                f"{(layer.out_features, rank)} (r={rank}), got {tuple(a.shape)} and {tuple(b.shape)}"
            )
        state[f"{name}.lora_A"], state[f"{name}.lora_B"] = a, b
    handle.configure_slot(slot, rank=rank, alpha=alpha, dropout=dropout, target_modules=wanted)
    handle.load_slot_state_dict(slot, state)
    # Modules the adapter lacks start as a fresh (identity) adapter rather than A = B = 0, which
    # would never get a gradient; seeded, so that an import is reproducible.
    generator = torch.Generator().manual_seed(0)
    for name in missing:
        handle.layers[name].reset_slot(slot, generator=generator)
    return {
        "rank": rank,
        "alpha": alpha,
        "dropout": dropout,
        "target_modules": config.get("target_modules"),
        "base_model_name_or_path": config.get("base_model_name_or_path"),
    }


def adapter_tar_bytes(adapter_dir: str | os.PathLike[str]) -> bytes:
    """An uncompressed tar of the two adapter files (the pool's upload body), byte-reproducible."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ADAPTER_FILES:
            data = (Path(adapter_dir) / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def adapter_files_bytes(adapter_dir: str | os.PathLike[str]) -> int:
    """Total size in bytes of the adapter files."""
    return sum((Path(adapter_dir) / name).stat().st_size for name in ADAPTER_FILES)


def _safetensors_header(path: Path) -> dict[str, object]:
    """Each tensor's {"dtype", "shape"}, as the file's header gives them (no data is read)."""
    with safe_open(path, "pt") as f:
        names: list[str] = f.keys()  # a safe_open is no mapping: it has keys() but no iteration
        return {
            name: {"dtype": f.get_slice(name).get_dtype(), "shape": f.get_slice(name).get_shape()}
            for name in names
        }


def _replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        os.rename(src, dst)
        return
    # rename(2) cannot replace a non-empty directory: move the old one aside first.
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.rename(dst, old / dst.name)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


GZIP_MAGIC = b"\x1f\x8b"
MAX_ADAPTER_ARCHIVE_MEMBERS = 8
"""An adapter archive holds two files; the service's own uploads allow 8 members."""
MAX_ADAPTER_ARCHIVE_BYTES = 8 * 1024**3
"""The most member data an adapter archive may unpack to (the SDK's bound too)."""


def unpack_adapter_archive(data: bytes, dest: str | os.PathLike[str]) -> Path:
    """Write the PEFT files of an adapter archive (tar or tar.gz, as the service serves them) into
    `dest`. Only regular members named as the adapter files are read: nothing else of the archive
    reaches the file system."""
    # The headers are checked before tarfile reads them (contracts/tar_headers.py: Python's own parse
    # of a hostile pax header is quadratic before 3.11.10), through the one compression the bytes
    # name, streamed: the decompressed archive is never held whole.
    gz = data[:2] == GZIP_MAGIC
    try:
        check_tar_headers(
            gzip.GzipFile(fileobj=io.BytesIO(data)) if gz else io.BytesIO(data),
            max_members=MAX_ADAPTER_ARCHIVE_MEMBERS,
            max_data_bytes=MAX_ADAPTER_ARCHIVE_BYTES,
        )
    except (TarHeaderProblem, EOFError, OSError, zlib.error) as exc:  # OSError: gzip's "not a gzip"
        raise ValueError(f"the adapter archive is refused: {exc}") from exc
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    found: set[str] = set()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz" if gz else "r:") as tar:
        for member in tar.getmembers():
            if member.name in ADAPTER_FILES and member.isfile():
                f = tar.extractfile(member)
                assert f is not None  # a regular file
                (out / member.name).write_bytes(f.read())
                found.add(member.name)
    missing = sorted(set(ADAPTER_FILES) - found)
    if missing:
        raise ValueError(f"the adapter archive lacks {missing}")
    return out

"""The PEFT LoRA adapters the pool can import (trainer_core/export.py `import_peft_adapter`), checked
on their `adapter_config.json` and the header of their `adapter_model.safetensors` alone: names,
dtypes and shapes, no tensor data, no torch. The service runs the same checks on an uploaded adapter
(POST /v1/adapters, app/adapters/uploads.py), so that what the pool would refuse is a 422 naming the
tensor when the adapter is uploaded, not a run evicted when it starts from it.

    adapter_model.safetensors    base_model.model.<module>.lora_A.weight  (r, in_features)
                                 base_model.model.<module>.lora_B.weight  (out_features, r)

Whether `<module>` exists in the base model, and its features, is for the caller to say
(`ModuleDims`): the pool knows its wrapped layers by name; the service only what the pool registered
(the adaptable module types, their features, the number of layers).
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TypeGuard

from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from contracts.run_config import LoraSettings

PEFT_PREFIX = "base_model.model."
"""PEFT wraps the causal LM in `base_model.model`: every tensor's name starts so."""

FACTOR_SUFFIXES = {".lora_A.weight": "lora_A", ".lora_B.weight": "lora_B"}

FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3"})
"""The safetensors dtypes a LoRA factor may have: the pool trains float weights only."""

UNSUPPORTED_FEATURES = (
    "use_dora",
    "use_rslora",
    "fan_in_fan_out",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
)
"""PEFT options a slot cannot represent (one rank and alpha for every module, plain A and B): set to
anything but false, null or empty, the adapter is refused."""

MAX_TENSOR_DIMS = 8
"""The most dimensions a tensor of an adapter may have. A LoRA factor has 2 (A (r, in), B (out, r));
8 leaves room for any layer type a pool might one day adapt (a 3-D convolution's kernel has 5) and
bounds the arithmetic on a shape an uploader wrote: the product of 80,000 dimensions of 10**18 took
49 s of big-integer multiplication, holding the GIL (every other request of the process waited)."""

MAX_ADAPTER_TENSORS = 16_384
"""The most tensors an adapter's safetensors file may list: two factors per adapted module, at most 8
module types per layer (a run's `lora.target_modules`, contracts/run_config.py), so 1,024 layers (the
largest models have ~130). Where the pool's model is known (an uploaded adapter, against the live pool
of its base model) its own count bounds it more tightly. A header of 1,000,000 tensors cost 104 s of
CPU, 2 GB of memory and a 331 MB 422 (one problem per tensor)."""

MAX_SHOWN_CHARS = 100
"""A tensor's or module's name, or a value of adapter_config.json, in a message: the uploader's text,
as long as the file holding it, shown up to this many characters."""

MAX_SHOWN_DIMS = 4
"""A shape in a message: its first dimensions, then how many it has."""

ModuleDims = Callable[[str], tuple[int, int] | str]
"""A module's qualified name in the base model ("model.layers.0.self_attn.q_proj") → its
(in_features, out_features), or why the model has no such module to adapt."""


@dataclass(frozen=True)
class AdapterProblem:
    field: str
    """The key of adapter_config.json at fault ("r", "lora_alpha", ...), or ADAPTER_WEIGHTS for a tensor."""
    message: str
    """Names the tensor (or the module) and says what is wrong."""


def split_factor(name: str) -> tuple[str, str] | None:
    """(module, "lora_A" | "lora_B") of a tensor named as the pool exports and imports them; None for
    any other name (another prefix, no `.weight` suffix, not a LoRA factor)."""
    if not name.startswith(PEFT_PREFIX):
        return None
    for suffix, factor in FACTOR_SUFFIXES.items():
        if name.endswith(suffix) and len(name) > len(PEFT_PREFIX) + len(suffix):
            return name[len(PEFT_PREFIX) : -len(suffix)], factor
    return None


def shown(value: object) -> str:
    """`value!r` for a message, cut to MAX_SHOWN_CHARS characters (the rest counted): an integer of
    hundreds of digits by its length, not its digits."""
    if whole_number(value) and abs(value) >= 10**20:
        return f"(an integer of {len(str(abs(value)))} digits)"
    if isinstance(value, str) and len(value) > MAX_SHOWN_CHARS:
        return f"{value[:MAX_SHOWN_CHARS]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[:MAX_SHOWN_CHARS]}... ({len(text)} characters)"


def shown_shape(shape: object) -> str:
    """A tensor's shape for a message: `[16, 4096]`; a long one by its first MAX_SHOWN_DIMS dimensions
    and its length (`[1, 2, 3, 4, ... (80000 dimensions)]`), each dimension as `shown` puts it."""
    if not isinstance(shape, list):
        return shown(shape)
    dims = ", ".join(shown(d) for d in shape[:MAX_SHOWN_DIMS])
    return f"[{dims}]" if len(shape) <= MAX_SHOWN_DIMS else f"[{dims}, ... ({len(shape)} dimensions)]"


def whole_number(value: object) -> TypeGuard[int]:
    """A JSON integer (`true` parses as a bool, which Python counts as an int: no rank)."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite_positive(value: object) -> TypeGuard[int | float]:
    """A JSON number > 0 that is a finite float (`Infinity` and `NaN` parse; 1e999 is Infinity; an
    integer too large for a float is no alpha)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:
        return False


@dataclass(frozen=True)
class Bounds:
    """An interval of numbers, as a pydantic Field's ge/gt/le/lt put it."""

    low: float = -math.inf
    low_closed: bool = True
    high: float = math.inf
    high_closed: bool = True

    def holds(self, value: float) -> bool:
        """Exact for integers of any size (Python compares an int with a float exactly, no float() of
        the int that could overflow); NaN holds in no interval."""
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def __str__(self) -> str:
        return (
            f"{'[' if self.low_closed else '('}{self.low:g}, {self.high:g}{']' if self.high_closed else ')'}"
        )


def run_config_bounds(field: str) -> Bounds:
    """The bounds RunConfig puts on `lora.<field>` (contracts/run_config.py LoraSettings): an adapter
    with a value outside them could never be started from, as `init_from` needs the run's own value."""
    bounds = Bounds()
    for rule in LoraSettings.model_fields[field].metadata:  # annotated_types' Ge, Gt, Le, Lt
        if (value := getattr(rule, "ge", None)) is not None:
            bounds = replace(bounds, low=value, low_closed=True)
        if (value := getattr(rule, "gt", None)) is not None:
            bounds = replace(bounds, low=value, low_closed=False)
        if (value := getattr(rule, "le", None)) is not None:
            bounds = replace(bounds, high=value, high_closed=True)
        if (value := getattr(rule, "lt", None)) is not None:
            bounds = replace(bounds, high=value, high_closed=False)
    return bounds


RANK_BOUNDS = run_config_bounds("rank")
ALPHA_BOUNDS = run_config_bounds("alpha")
DROPOUT_BOUNDS = run_config_bounds("dropout")


def _number(value: object) -> TypeGuard[int | float]:
    """A JSON number (not `true`, which Python counts as an int)."""
    return not isinstance(value, bool) and isinstance(value, int | float)


def _named(key: str, value: object) -> str:
    """`key=value` for a message; an integer of hundreds of digits by its length, not its digits."""
    if whole_number(value) and abs(value) >= 10**20:
        return f"{key} (an integer of {len(str(abs(value)))} digits)"
    return f"{key}={shown(value)}"


def _of_a_run(field: str) -> str:
    return f"the lora.{field} a run's config accepts: no run could start from this adapter"


def _rank_problem(rank: object, *, max_rank: int) -> AdapterProblem | None:
    """The rank: an integer (8.0 is a float, not a rank), within the pool's max_rank and RunConfig's
    lora.rank bounds, the tighter one named."""
    if not whole_number(rank):
        return AdapterProblem("r", f"rank {_named('r', rank)} must be an integer")
    if not RANK_BOUNDS.holds(rank):
        return AdapterProblem("r", f"rank {_named('r', rank)} is outside {RANK_BOUNDS}, {_of_a_run('rank')}")
    if rank > max_rank:
        return AdapterProblem("r", f"rank r={rank} is outside [1, {max_rank}] (the pool's max_rank)")
    return None


def config_problems(config: object, *, max_rank: int) -> list[AdapterProblem]:
    """What in adapter_config.json the pool cannot load, or no run could use: not LoRA, a feature a
    slot cannot represent, a rank that is not an integer or is outside [1, max_rank] or RunConfig's
    lora.rank bounds, an alpha that is not a number or is outside RunConfig's lora.alpha bounds, a
    dropout outside RunConfig's lora.dropout bounds."""
    if not isinstance(config, Mapping):
        return [AdapterProblem("body", f"{ADAPTER_CONFIG} must be a JSON object")]
    problems: list[AdapterProblem] = []
    if config.get("peft_type") != "LORA":
        problems.append(
            AdapterProblem("peft_type", f"peft_type is {shown(config.get('peft_type'))}, not 'LORA'")
        )
    used = [key for key in UNSUPPORTED_FEATURES if config.get(key)]
    if config.get("bias", "none") != "none":
        used.append("bias")
    for key in used:
        problems.append(
            AdapterProblem(
                key, f"unsupported adapter features: {key}={shown(config[key])} (a slot is a plain LoRA)"
            )
        )
    if (rank_problem := _rank_problem(config.get("r"), max_rank=max_rank)) is not None:
        problems.append(rank_problem)
    alpha = config.get("lora_alpha")
    if not _number(alpha) or alpha != alpha:  # NaN
        problems.append(
            AdapterProblem("lora_alpha", f"lora_alpha={shown(alpha)} must be a finite number > 0")
        )
    elif not ALPHA_BOUNDS.holds(alpha):
        message = (
            f"{_named('lora_alpha', alpha)} must be a finite number > 0"
            if alpha <= 0
            else f"{_named('lora_alpha', alpha)} is outside {ALPHA_BOUNDS}, {_of_a_run('alpha')}"
        )
        problems.append(AdapterProblem("lora_alpha", message))
    if "lora_dropout" in config:
        dropout = config["lora_dropout"]
        if not _number(dropout) or not DROPOUT_BOUNDS.holds(dropout):
            problems.append(
                AdapterProblem(
                    "lora_dropout", f"{_named('lora_dropout', dropout)} must be a number in {DROPOUT_BOUNDS}"
                )
            )
    return problems


def weights_problems(header: Mapping[str, object], *, rank: object, dims: ModuleDims) -> list[AdapterProblem]:
    """What in the safetensors header (name → {"dtype", "shape", ...}; `__metadata__` skipped) the pool
    cannot load: a name not of a LoRA factor, a module `dims` does not know, a dtype that is not
    floating point, a shape other than A (r, in) and B (out, r) with the config's `rank` (not checked
    when the rank is not a whole number: that is the config's problem), a module with one factor and
    not the other. One problem per tensor, in the header's order, then one per unpaired module; only
    one, before any tensor is looked at, when it lists more than MAX_ADAPTER_TENSORS."""
    tensors = len(header) - ("__metadata__" in header)
    if tensors > MAX_ADAPTER_TENSORS:
        return [_weights(too_many_tensors(tensors, MAX_ADAPTER_TENSORS))]
    problems: list[AdapterProblem] = []
    factors: dict[str, list[str]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        split = split_factor(name)
        if split is None:
            problems.append(
                _weights(
                    f"unexpected tensor {shown(name)} (expected {PEFT_PREFIX}<module>.lora_A.weight or "
                    f"{PEFT_PREFIX}<module>.lora_B.weight)"
                )
            )
            continue
        module, factor = split
        factors.setdefault(module, []).append(factor)
        found = dims(module)
        dtype = info.get("dtype") if isinstance(info, Mapping) else None
        shape = info.get("shape") if isinstance(info, Mapping) else None
        if isinstance(found, str):
            problems.append(_weights(f"tensor {shown(name)}: {found}"))
        elif dtype not in FLOAT_DTYPES:
            problems.append(
                _weights(
                    f"tensor {shown(name)} has dtype {_bare(dtype)}, not floating point "
                    f"({', '.join(sorted(FLOAT_DTYPES))})"
                )
            )
        elif whole_number(rank):
            fan_in, fan_out = found
            want = [rank, fan_in] if factor == "lora_A" else [fan_out, rank]
            if shape != want:
                problems.append(
                    _weights(
                        f"tensor {shown(name)} has shape {shown_shape(shape)}, expected {want} (r={rank})"
                    )
                )
    for module, found_factors in factors.items():
        if sorted(found_factors) != ["lora_A", "lora_B"]:
            problems.append(
                _weights(
                    f"layer {shown(PEFT_PREFIX + module)} has {_factors(found_factors)}: "
                    "it needs one lora_A and one lora_B"
                )
            )
    return problems


def adapter_problems(
    config: object, header: Mapping[str, object], *, max_rank: int, dims: ModuleDims
) -> list[AdapterProblem]:
    """Every problem `config_problems` and `weights_problems` find (an empty list: the pool can load
    the adapter into a model whose modules `dims` describes, strictness about the modules it lacks
    aside)."""
    rank = config.get("r") if isinstance(config, Mapping) else None
    return config_problems(config, max_rank=max_rank) + weights_problems(header, rank=rank, dims=dims)


def too_many_tensors(count: int, limit: int, *, of: str = "an adapter") -> str:
    return f"it lists {count} tensors; {of} has at most {limit} (a lora_A and a lora_B per adapted module)"


def _weights(message: str) -> AdapterProblem:
    return AdapterProblem(ADAPTER_WEIGHTS, message)


def _bare(value: object) -> str:
    """A dtype as the header names it (`I32`), unquoted when it is a short string."""
    return value if isinstance(value, str) and len(value) <= MAX_SHOWN_CHARS else shown(value)


def _factors(found: list[str]) -> str:
    """A module's factors for a message: `['lora_A']`, or by count when there are many."""
    if len(found) <= MAX_SHOWN_DIMS:
        return str(sorted(found))
    return f"{found.count('lora_A')} lora_A and {found.count('lora_B')} lora_B factors"

"""Many LoRA adapters ("slots") over one frozen linear layer, trained in the same forward/backward.

For a token x of slot s, with A_s (r × in), B_s (out × r), rank r_s, scaling alpha_s / r_s and
dropout p_s:

    y = W x + b + (alpha_s / r_s) · B_s A_s dropout_{p_s}(x)

A packed micro-batch holds T tokens ordered by ascending slot; `counts[s]` of them belong to
slot s (a slot with no tokens has count 0, gets no gradient, and costs nothing). Every slot
stores `max_rank` rows of A and columns of B so that all slots share one shape (one grouped
matmul); a slot configured with r_s < max_rank keeps the rows/columns from r_s on at zero, and
they stay zero under any optimizer (see `MultiLoRALinear`).

Inside a Hugging Face model a linear layer is called as `linear(x)`, so the counts travel in a
`SegmentContext` that `apply_multi_lora` creates once and shares by reference with every wrapped
layer; `MultiLoRA.segments(counts)` sets it for the duration of one forward (and backward, when
activations are recomputed) and restores it on exit. Nothing lives at module level.

    handle = apply_multi_lora(model, ["q_proj", "v_proj"], n_slots=8, max_rank=16)
    handle.configure_slot(3, rank=8, alpha=16.0, dropout=0.0)
    handle.reset_slot(3, seed=1234)
    with handle.segments(counts):          # counts: (n_slots,) ints summing to the tokens
        loss = loss_fn(model(input_ids).logits)
        loss.backward()
"""

import math
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PathName = Literal["grouped", "loop", "auto"]
Counts = Tensor | Sequence[int]

# torch >= 2.9 exposes the public op; older releases only the private one. Same signature.
_GROUPED_MM: Callable[..., Tensor] | None = getattr(F, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)

# Dtypes for which "auto" picks the grouped kernel, per device type (other devices: loop).
# - cuda: the kernel is documented for bf16 on SM >= 80 (checked below); there it replaces the
#   loop's handful of small kernels per active slot and layer (forward and backward) by a fixed
#   few, which is what keeps N adapters as cheap as one on a GPU. Other dtypes are not
#   documented for it on CUDA: loop.
# - cpu (torch 2.13): grouped_mm runs for fp32/bf16/fp16. T=4096, in=out=512, r=16, 8 segments,
#   fwd+bwd, 1 thread: fp32 10.5 ms grouped vs 15.9 ms loop; bf16 9.6 vs 16.0; fp16 92 vs 96
#   (no gain, so loop); fp64 is unsupported.
_GROUPED_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "cuda": frozenset({torch.bfloat16}),
    "cpu": frozenset({torch.float32, torch.bfloat16}),
}
# The grouped kernels need every row stride to be a multiple of 16 bytes.
_GROUPED_ALIGN_BYTES = 16


@dataclass(frozen=True)
class SlotConfig:
    """A slot's LoRA hyper-parameters."""

    rank: int
    """r: rows of A / columns of B in use (the rest are zero)."""
    alpha: float
    """The delta is scaled by alpha / rank."""
    dropout: float
    """Dropout probability on the LoRA input (training mode only)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class SegmentLayout:
    """The slot segments of one packed micro-batch (tokens in ascending slot order)."""

    counts: tuple[int, ...]
    """Tokens per slot, one entry per slot."""
    active: tuple[int, ...] = field(init=False)
    """Slots with at least one token, ascending."""
    active_counts: tuple[int, ...] = field(init=False)
    total: int = field(init=False)
    _device_cache: dict[tuple[str, torch.device], Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if any(c < 0 for c in self.counts):
            raise ValueError(f"slot token counts must be >= 0, got {list(self.counts)}")
        active = tuple(s for s, c in enumerate(self.counts) if c > 0)
        object.__setattr__(self, "active", active)
        object.__setattr__(self, "active_counts", tuple(self.counts[s] for s in active))
        object.__setattr__(self, "total", sum(self.counts))

    @classmethod
    def from_counts(cls, counts: Counts, n_slots: int) -> "SegmentLayout":
        """Validate and copy `counts` to the host (one device sync per micro-batch, not per layer)."""
        values = counts.tolist() if isinstance(counts, Tensor) else list(counts)
        if len(values) != n_slots:
            raise ValueError(f"expected {n_slots} slot token counts, got {len(values)}")
        try:
            return cls(tuple(operator.index(c) for c in values))
        except TypeError:
            raise TypeError(f"slot token counts must be integers, got {values}") from None

    def offsets(self, device: torch.device) -> Tensor:
        """Cumulative segment ends of the active slots, int32, as grouped_mm wants them."""
        return self._cached("offs", device, lambda: torch.tensor(self.active_counts).cumsum(0).int())

    def active_index(self, device: torch.device) -> Tensor:
        """The active slot numbers as an index tensor."""
        return self._cached("index", device, lambda: torch.tensor(self.active, dtype=torch.long))

    def _cached(self, kind: str, device: torch.device, make: Callable[[], Tensor]) -> Tensor:
        # Shared by every layer of one forward: one host-to-device copy per micro-batch.
        key = (kind, device)
        if key not in self._device_cache:
            self._device_cache[key] = make().to(device)
        return self._device_cache[key]


class SegmentContext:
    """The segment layout of the forward in progress, shared by reference by all wrapped layers.

    Set only through `MultiLoRA.segments`; `None` means "no LoRA" (the base model's output).
    """

    def __init__(self) -> None:
        self.layout: SegmentLayout | None = None


def grouped_mm_available() -> bool:
    """Whether this torch has a grouped GEMM op at all."""
    return _GROUPED_MM is not None


def grouped_mm_unsupported_reason(
    device: torch.device, dtype: torch.dtype, dims: Sequence[int], *, for_auto: bool
) -> str | None:
    """Why the grouped path cannot (or, for "auto", should not) run here; None if it can."""
    if _GROUPED_MM is None:
        return "this torch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    if dtype == torch.float64:
        return "grouped_mm does not support float64"
    itemsize = torch.empty((), dtype=dtype).element_size()
    if any((d * itemsize) % _GROUPED_ALIGN_BYTES for d in dims):
        return f"grouped_mm needs row strides that are multiples of {_GROUPED_ALIGN_BYTES} bytes; dims {list(dims)}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "grouped_mm needs a CUDA device with SM >= 80"
    if for_auto and dtype not in _GROUPED_DTYPES.get(device.type, frozenset()):
        return f"the grouped kernel is not the faster/supported path for {dtype} on {device.type}"
    return None


def master_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype LoRA weights train in on a base of ``base_dtype``: fp32 for a half type, else the same."""
    return torch.float32 if base_dtype in (torch.bfloat16, torch.float16) else base_dtype


class MultiLoRALinear(nn.Module):
    """A frozen `nn.Linear` plus `n_slots` LoRA adapters; each token uses its slot's adapter.

        y_t = W x_t + b + (alpha_s / r_s) · B_s A_s dropout_{p_s}(x_t)     for token t of slot s

    Parameters per slot s (separate leaves, so a run's optimizer owns exactly its slot):
    `lora_A[s]` (max_rank, in), `lora_B[s]` (out, max_rank). Slot s uses the first r_s rows of A
    and columns of B; the rest are zero and stay zero: the forward (both paths) multiplies B by a
    scaling that is zero beyond r_s, so their gradient is exactly zero,
    Adam's update of a zero gradient is zero, and decoupled weight decay scales zero to zero.

    Args:
        base: the linear layer to wrap; frozen here.
        n_slots: number of adapters.
        max_rank: rows of A / columns of B stored per slot.
        dropout: initial dropout of every slot (see `configure_slot`).
        segment_context: where the counts come from when `forward` is called without them.
        dtype: dtype of the LoRA parameters (default: `master_dtype` of the base weight's: fp32 on a
            bf16/fp16 base, else the base's). The delta is computed in
            the activations' dtype (the base's): with fp32 parameters on a bf16 base the parameters
            are master weights, cast to bf16 for the matmuls, and their gradients and optimizer state
            stay fp32 (mixed precision as torch.autocast does it).
        path: "grouped" (one grouped matmul per factor), "loop" (per-segment matmuls, the
            reference) or "auto" (grouped where it runs and pays off, see `_GROUPED_DTYPES`).
    """

    lora_scaling: Tensor
    """(n_slots, max_rank) buffer: alpha_s / r_s on a slot's first r_s entries, 0 beyond."""

    def __init__(
        self,
        base: nn.Linear,
        n_slots: int,
        max_rank: int,
        *,
        dropout: float = 0.0,
        segment_context: SegmentContext | None = None,
        dtype: torch.dtype | None = None,
        path: PathName = "auto",
    ) -> None:
        super().__init__()
        if n_slots < 1 or max_rank < 1:
            raise ValueError(f"n_slots and max_rank must be >= 1, got {n_slots}, {max_rank}")
        _check_path(path)
        self.base = base.requires_grad_(False)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.n_slots = n_slots
        self.max_rank = max_rank
        self.segment_context = segment_context
        self.path: PathName = path
        device = base.weight.device
        param_dtype = dtype if dtype is not None else master_dtype(base.weight.dtype)
        self.lora_A = nn.ParameterList(
            nn.Parameter(torch.zeros(max_rank, self.in_features, device=device, dtype=param_dtype))
            for _ in range(n_slots)
        )
        self.lora_B = nn.ParameterList(
            nn.Parameter(torch.zeros(self.out_features, max_rank, device=device, dtype=param_dtype))
            for _ in range(n_slots)
        )
        # (n_slots, max_rank): alpha_s / r_s on the first r_s entries, 0 beyond. Derived from the
        # slot configs (which checkpoints store), hence not persistent.
        self.register_buffer(
            "lora_scaling", torch.zeros(n_slots, max_rank, device=device, dtype=param_dtype), persistent=False
        )
        # Each slot's A and B stay leaves of their own (a run's optimizer owns exactly its slot); their
        # storage is a slice of one stack per factor, which the grouped kernels read without a copy.
        self._stack_a = _SlotStack(self.lora_A)
        self._stack_b = _SlotStack(self.lora_B)
        self._configs: list[SlotConfig] = []
        self._enabled = [True] * n_slots
        """Per slot: whether this layer is one of the slot's run's target modules (`set_slot_enabled`)."""
        for slot in range(n_slots):
            self._configs.append(SlotConfig(max_rank, float(max_rank), dropout))
            self.configure_slot(slot, rank=max_rank, alpha=float(max_rank), dropout=dropout)
            self.reset_slot(slot)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "MultiLoRALinear":
        """`module.to(...)` and friends give every parameter new storage: stack them again there, so
        the old stack does not stay behind on the old device or in the old dtype."""
        super()._apply(fn, recurse)
        self._stack_a.restack()
        self._stack_b.restack()
        return self

    # ---- slots -------------------------------------------------------------------------------

    def slot_config(self, slot: int) -> SlotConfig:
        return self._configs[self._check_slot(slot)]

    def configure_slot(self, slot: int, *, rank: int, alpha: float, dropout: float = 0.0) -> None:
        """Set a slot's rank, alpha and dropout; entries beyond the new rank are zeroed."""
        self._check_slot(slot)
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"rank must be in [1, {self.max_rank}] (max_rank), got {rank}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self._configs[slot] = SlotConfig(rank, float(alpha), float(dropout))
        with torch.no_grad():
            self.lora_A[slot][rank:].zero_()
            self.lora_B[slot][:, rank:].zero_()
        self._update_scaling(slot)

    def set_slot_enabled(self, slot: int, enabled: bool) -> None:
        """Whether the slot's run adapts this layer. A disabled slot adds no delta here (its scaling
        is 0, so neither path gives its factors a gradient) and its factors are zeroed."""
        self._enabled[self._check_slot(slot)] = enabled
        if not enabled:
            with torch.no_grad():
                self.lora_A[slot].zero_()
                self.lora_B[slot].zero_()
            self.lora_A[slot].grad = None
            self.lora_B[slot].grad = None
        self._update_scaling(slot)

    def slot_enabled(self, slot: int) -> bool:
        return self._enabled[self._check_slot(slot)]

    def _update_scaling(self, slot: int) -> None:
        cfg = self._configs[slot]
        with torch.no_grad():
            self.lora_scaling[slot].zero_()
            if self._enabled[slot]:
                self.lora_scaling[slot, : cfg.rank] = cfg.scaling

    def reset_slot(self, slot: int, *, generator: torch.Generator | None = None) -> None:
        """LoRA init of a slot: A Kaiming-uniform (as peft) on its first r rows, B zero → identity.

        The random numbers are drawn on the CPU (from `generator`, else the global CPU RNG), so
        the same generator state gives the same adapter on any device and in any slot. The
        slot's gradients are dropped; no other slot is touched.
        """
        rank = self.slot_config(slot).rank
        a, b = self.lora_A[slot], self.lora_B[slot]
        # kaiming_uniform_(a=sqrt(5)) on a (rank, in) weight is U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(self.in_features)
        init = torch.empty(rank, self.in_features).uniform_(-bound, bound, generator=generator)
        with torch.no_grad():
            a.zero_()
            if self._enabled[slot]:  # drawn either way: the slot's other layers get the same init
                a[:rank].copy_(init)
            b.zero_()
        a.grad = None
        b.grad = None

    def slot_parameters(self, slot: int) -> list[nn.Parameter]:
        self._check_slot(slot)
        return [self.lora_A[slot], self.lora_B[slot]]

    # ---- forward -----------------------------------------------------------------------------

    def forward(
        self, x: Tensor, slot_token_counts: Counts | None = None, *, path: PathName | None = None
    ) -> Tensor:
        """x: (..., in) whose leading dims flatten to T tokens in ascending slot order.

        `slot_token_counts` (n_slots,) sums to T; without it the shared `SegmentContext` is
        used, and without that the output is the base layer's alone.
        """
        out = self.base(x)  # (..., out)
        layout = self._layout(slot_token_counts)
        if layout is None:
            return out
        n_tokens = x.numel() // self.in_features
        if layout.total != n_tokens:
            raise ValueError(
                f"slot token counts sum to {layout.total} but the input has {n_tokens} tokens "
                f"(shape {tuple(x.shape)}); every token, padding included, must belong to a slot"
            )
        if not layout.active:
            return out
        x_flat = x.reshape(n_tokens, self.in_features)  # (T, in), in the compute dtype
        x_flat = self._segment_dropout(x_flat, layout)
        if self.resolve_path(x_flat.device, x_flat.dtype, layout, path) == "grouped":
            delta = self._delta_grouped(x_flat, layout)
        elif len(layout.active) == 1 and self._enabled[layout.active[0]] and out.dtype == x_flat.dtype:
            return self._add_one_segment(out, x_flat, layout.active[0])
        else:
            delta = self._delta_loop(x_flat, layout)  # (T, out)
        return out + delta.view(out.shape).to(out.dtype)

    def _slot_factors(self, slot: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A_s (R, in) and c_s ⊙ B_s (out, R) in the compute dtype: scaled in the master dtype, rounded
        once. The scaling row is zero beyond the slot's rank, so no slice to the rank is needed."""
        return self.lora_A[slot].to(dtype), (self.lora_B[slot] * self.lora_scaling[slot]).to(dtype)

    def _add_one_segment(self, out: Tensor, x: Tensor, slot: int) -> Tensor:
        """out + (x A_sᵀ)(c_s ⊙ B_s)ᵀ for a micro-batch of one slot: the second matmul and the add in
        one `addmm` (one kernel fewer per layer than `_delta_loop`'s, same gradients). In bf16 the sum
        is rounded once where the other paths round the delta and then the sum: a run's bf16 outputs
        differ by an ulp here and there depending on whether its micro-batch was shared (isolation in
        bf16 holds within rounding, as between the grouped and loop paths before)."""
        a, b = self._slot_factors(slot, x.dtype)
        y = torch.addmm(out.reshape(-1, self.out_features), x @ a.T, b.T)  # (T, out)
        return y.view(out.shape)

    def _layout(self, counts: Counts | None) -> SegmentLayout | None:
        if counts is not None:
            return SegmentLayout.from_counts(counts, self.n_slots)
        return self.segment_context.layout if self.segment_context is not None else None

    def _segment_dropout(self, x: Tensor, layout: SegmentLayout) -> Tensor:
        """Each segment with its own slot's dropout; shared by both paths so they see the same RNG."""
        probs = [self._configs[s].dropout for s in layout.active]
        if not self.training or not any(p > 0 for p in probs):
            return x
        parts = x.split(list(layout.active_counts))
        return torch.cat([F.dropout(part, p, training=True) for part, p in zip(parts, probs, strict=True)])

    def resolve_path(
        self, device: torch.device, dtype: torch.dtype, layout: SegmentLayout, path: PathName | None = None
    ) -> Literal["grouped", "loop"]:
        """The path a forward with this layout takes (`path` overrides the layer's setting)."""
        path = path or self.path
        _check_path(path)
        dims = (self.in_features, self.out_features, self.max_rank)
        if path == "grouped":
            reason = grouped_mm_unsupported_reason(device, dtype, dims, for_auto=False)
            if reason:
                raise RuntimeError(f"path='grouped' cannot run: {reason}")
            return "grouped"
        if path == "loop":
            return "loop"
        # auto: a single segment is one plain matmul pair, nothing to group. (`_GroupedDelta` runs one
        # segment as plain matmuls with the kernels of N, but its Python backward costs more host time
        # than autograd's own nodes for the loop's few ops: measured, docs/benchmarks.md.)
        multi = len(layout.active) > 1
        if multi and grouped_mm_unsupported_reason(device, dtype, dims, for_auto=True) is None:
            return "grouped"
        return "loop"

    def _delta_grouped(self, x: Tensor, layout: SegmentLayout) -> Tensor:
        """All active segments in one autograd node: h = x A_gᵀ, y = h (c_g ⊙ B_g)ᵀ, per group g.

        The slots' factors are read from the stacks they live in (`_SlotStack`: no stacking copy per
        pass), cast to the compute dtype once, and `_GroupedDelta` computes the gradients
        itself, handing each slot its slice — what made N adapters cost more launches than one was
        the generic autograd graph of stack, cast and scale per layer (see the class)."""
        slots = layout.active
        a_all, b_all = self._stack_a.current(slots), self._stack_b.current(slots)
        scaling = self.lora_scaling
        index = None
        if slots[-1] - slots[0] + 1 == len(slots):  # consecutive slots (one, all): views, no copy
            a_all, b_all, scaling = (t[slots[0] : slots[-1] + 1] for t in (a_all, b_all, scaling))
        else:
            index = layout.active_index(x.device)
        enabled = tuple(self._enabled[s] for s in slots)
        a_params, b_params = self._stack_a.params, self._stack_b.params
        params = [a_params[s] for s in slots] + [b_params[s] for s in slots]
        offs = layout.offsets(x.device)  # (G,)
        return _GroupedDelta.apply(x.contiguous(), a_all, b_all, scaling, index, offs, enabled, *params)

    def _delta_loop(self, x: Tensor, layout: SegmentLayout) -> Tensor:
        """The reference: one (x_s A_sᵀ) (alpha/r · B_s)ᵀ per segment.

        The whole max_rank rows/columns are used, not a slice to the slot's rank: B is scaled by the
        slot's row of `lora_scaling`, zero beyond its rank (as on the grouped path), which cuts those
        entries out of the delta and their gradients. Slicing would cost each factor a slice backward
        (a zero fill and a copy: ~670 kernel launches per pass of a 24-layer model with LoRA on all
        seven linears, 12 % of it)."""
        # One segment is x itself (a split's backward would copy its gradient through a cat).
        parts = x.split(list(layout.active_counts)) if len(layout.active) > 1 else (x,)
        deltas = []
        for slot, part in zip(layout.active, parts, strict=True):
            if not self._enabled[slot]:
                deltas.append(part.new_zeros(part.shape[0], self.out_features))
                continue
            a, b = self._slot_factors(slot, x.dtype)
            deltas.append((part @ a.T) @ b.T)  # (T_s, out)
        return torch.cat(deltas) if len(deltas) > 1 else deltas[0]

    def _check_slot(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.n_slots})")
        return slot

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, n_slots={self.n_slots}, max_rank={self.max_rank}"


class _SlotStack:
    """One factor's slot parameters (the layer's `nn.ParameterList`), and the (n_slots, ...) stack whose
    slices they are.

    Anything that gives a parameter new storage (``module.to(...)``, ``param.data = ...``) or puts a new
    parameter in the list (``load_state_dict(assign=True)``, ``lora_A[s] = ...``) ends the sharing;
    `current` notices for the slots a pass reads and re-stacks, keeping the values and the parameter
    objects in the list (hence their optimizer state). The check is one pointer per slot read, against
    the address of its slice in the stack this object holds (so no other tensor can live there)."""

    def __init__(self, params: nn.ParameterList) -> None:
        self.params = params
        self.restack()

    def current(self, slots: Sequence[int]) -> Tensor:
        """The stack, re-stacked first if one of ``slots`` (those the caller reads) is not its slice."""
        stack, params = self.stack, self.params
        base, step = stack.data_ptr(), stack.stride(0) * stack.element_size()
        if any(params[s].data_ptr() != base + s * step for s in slots):
            self.restack()
        return self.stack

    def restack(self) -> None:
        self.stack = torch.stack([p.detach() for p in self.params])
        with torch.no_grad():
            for s, p in enumerate(self.params):
                p.data = self.stack[s]


class _GroupedDelta(torch.autograd.Function):
    """The LoRA delta of all active slots, (T, in) → (T, out), with its own backward.

    Inputs: x (T, in) in the compute dtype; the factor stacks a_all (n, R, in), b_all (n, out, R) and
    scaling (n, R) in the master dtype; ``index`` (G,) of the active slots among the n, or None when
    they are all n (the caller passes the stacks narrowed to a run of consecutive active slots);
    ``offs`` (G,) segment ends; ``enabled`` per active slot; then the active slots' A parameters and
    their B parameters (2G leaves — inputs only so that autograd routes each slot its gradient; the
    values are read from the stacks, of which they are slices).

    Why a function of its own: written with autograd's generic ops, N slots cost ~7 more kernel
    launches per layer and pass than one (stack A, stack B, casts of each, select and cast the
    scaling, scale; their backwards), ~1,200 on a 24-layer model with LoRA on all seven linears,
    which on a GPU is host time the step waits for. Here one slot and N consecutive slots launch the
    same kernels: forward cast A, scale-and-cast B (one `mul` into a compute-dtype output), two
    matmuls; backward four matmuls and two casts back to the master dtype (active slots with gaps
    between them add an `index_select` of A, B and the scaling). One group runs as plain matmuls,
    several as grouped matmuls over the segments.

    The gradients are those of ``y = x Aᵀ (c ⊙ B)ᵀ`` per segment, computed in the compute dtype
    and cast to the master dtype (as autocast's backward of the casts does); a disabled slot
    (`set_slot_enabled`) has zero scaling, so zero delta, and gets no gradient (None), as on the loop
    path.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        a_all: Tensor,
        b_all: Tensor,
        scaling: Tensor,
        index: Tensor | None,
        offs: Tensor,
        enabled: tuple[bool, ...],
        *params: Tensor,
    ) -> Tensor:
        if index is not None:
            a_all, b_all, scaling = (t.index_select(0, index) for t in (a_all, b_all, scaling))
        a = a_all.to(x.dtype)  # (G, R, in)
        b = torch.empty(b_all.shape, dtype=x.dtype, device=x.device)
        torch.mul(b_all, scaling[:, None, :], out=b)  # (G, out, R): scaled, then rounded once
        if len(enabled) == 1:
            h = x @ a[0].T  # (T, R)
            y = h @ b[0].T  # (T, out)
        else:
            assert _GROUPED_MM is not None  # resolve_path chose "grouped" only where it exists
            h = _GROUPED_MM(x, a.transpose(1, 2), offs=offs)
            y = _GROUPED_MM(h, b.transpose(1, 2), offs=offs)
        ctx.save_for_backward(x, a, b, h, offs, scaling)
        ctx.enabled = enabled
        ctx.master_dtype = a_all.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        x, a, b, h, offs, scaling = ctx.saved_tensors
        enabled: tuple[bool, ...] = ctx.enabled
        grad_y = grad_y.contiguous()  # e.g. expanded, from out.sum().backward()
        if len(enabled) == 1:
            grad_h = grad_y @ b[0]  # (T, R)
            grad_b = (grad_y.T @ h)[None]  # (1, out, R)
            grad_x = grad_h @ a[0] if ctx.needs_input_grad[0] else None  # (T, in)
            grad_a = (grad_h.T @ x)[None]  # (1, R, in)
        else:
            assert _GROUPED_MM is not None
            grad_h = _GROUPED_MM(grad_y, b, offs=offs)  # (T, R)
            grad_b = _GROUPED_MM(grad_y.T, h, offs=offs)  # (G, out, R): segment g's grad_yᵀ h
            grad_x = _GROUPED_MM(grad_h, a, offs=offs) if ctx.needs_input_grad[0] else None
            grad_a = _GROUPED_MM(grad_h.T, x, offs=offs)  # (G, R, in)
        master: torch.dtype = ctx.master_dtype
        grads_a = grad_a.to(master).unbind(0)
        grads_b = torch.mul(grad_b, scaling[:, None, :]).to(master).unbind(0)  # d/dB of c ⊙ B
        keep = [on and need for on, need in zip(enabled * 2, ctx.needs_input_grad[7:], strict=True)]
        slot_grads = [g if k else None for g, k in zip(grads_a + grads_b, keep, strict=True)]
        return (grad_x, None, None, None, None, None, None, *slot_grads)


def _check_path(path: str) -> None:
    if path not in ("grouped", "loop", "auto"):
        raise ValueError(f"path must be 'grouped', 'loop' or 'auto', got {path!r}")


class MultiLoRA:
    """The handle `apply_multi_lora` returns: slot management over every wrapped layer.

    Parameter and state-dict names are "<qualified module name>.lora_A" / ".lora_B", e.g.
    "model.layers.0.self_attn.q_proj.lora_A", tensors sliced to the slot's rank:
    A (r, in), B (out, r).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: dict[str, MultiLoRALinear],
        *,
        n_slots: int,
        max_rank: int,
        target_modules: tuple[str, ...],
        context: SegmentContext,
    ) -> None:
        self.model = model
        self.layers = layers
        self.n_slots = n_slots
        self.max_rank = max_rank
        self.target_modules = target_modules
        self.context = context

    @contextmanager
    def segments(self, counts: Counts) -> Iterator[SegmentLayout]:
        """Route the model's tokens to slots for the forward (and backward) run inside the block.

        With gradient checkpointing enabled through `enable_gradient_checkpointing`, the backward may
        also run after the block: each recomputation restores the layout its forward saw.
        """
        layout = SegmentLayout.from_counts(counts, self.n_slots)
        with self._layout(layout):
            yield layout

    @contextmanager
    def _layout(self, layout: SegmentLayout | None) -> Iterator[None]:
        previous = self.context.layout
        self.context.layout = layout
        try:
            yield
        finally:
            self.context.layout = previous

    def recompute_context(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """``context_fn`` of `torch.utils.checkpoint.checkpoint` (non-reentrant): called when a checkpointed
        layer runs forward, it captures the segment layout in force; the second context re-installs it
        around that layer's recomputation in the backward (which may run outside `segments`, or inside
        another micro-batch's), so the recomputed forward routes tokens to the same slots."""
        return nullcontext(), self._layout(self.context.layout)

    def enable_gradient_checkpointing(self, *, every_n_layers: int = 1) -> None:
        """Recompute each decoder layer's activations in the backward instead of keeping them.

        transformers' activation checkpointing (non-reentrant, with `recompute_context`), active while
        the model is in training mode. Memory per layer drops to its input; compute grows by about one
        forward. Gradients are unchanged (dropout replays the same RNG state).
        """
        enable = getattr(self.model, "activation_checkpointing_enable", None) or getattr(
            self.model, "gradient_checkpointing_enable", None
        )
        if enable is None:
            raise TypeError(f"{type(self.model).__name__} does not support activation checkpointing")
        kwargs = {"use_reentrant": False, "context_fn": self.recompute_context}
        if every_n_layers != 1:
            enable(kwargs, every_n_layers=every_n_layers)
        else:
            enable(kwargs)
        # transformers makes the embeddings' output require grad for *reentrant* checkpointing; the
        # non-reentrant kind does not need it, and it would add a backward into the embeddings.
        disable_input_grads = getattr(self.model, "disable_input_require_grads", None)
        if disable_input_grads is not None:
            disable_input_grads()

    def configure_slot(
        self,
        slot: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        target_modules: Sequence[str] | None = None,
    ) -> None:
        """The slot's rank, alpha, dropout and the modules its run adapts (None: every wrapped one).

        A layer whose last name component is not in `target_modules` is masked for this slot: no
        delta, no parameters in `slot_parameters` (so no optimizer state, no gradient all-reduce),
        nothing in `slot_state_dict`, checkpoints and the exported adapter."""
        wanted = self.target_modules if target_modules is None else tuple(target_modules)
        enabled = {name: name.rpartition(".")[2] in wanted for name in self.layers}
        if not any(enabled.values()):
            raise ValueError(
                f"target_modules {list(wanted)} match none of this pool's {list(self.target_modules)}"
            )
        for name, layer in self.layers.items():
            layer.configure_slot(slot, rank=rank, alpha=alpha, dropout=dropout)
            layer.set_slot_enabled(slot, enabled[name])

    def slot_layers(self, slot: int) -> dict[str, MultiLoRALinear]:
        """The layers the slot's run adapts, by qualified name (module order)."""
        return {name: layer for name, layer in self.layers.items() if layer.slot_enabled(slot)}

    def slot_target_modules(self, slot: int) -> tuple[str, ...]:
        """The slot's target modules (last name components), sorted."""
        return tuple(sorted({name.rpartition(".")[2] for name in self.slot_layers(slot)}))

    def reset_slot(self, slot: int, *, seed: int | None = None) -> None:
        """Fresh LoRA init of `slot` in every layer (identity: B = 0); other slots untouched.

        With `seed`, the init depends on the seed alone (not on the slot, the device or the
        global RNG); without it, it is drawn from the global CPU RNG.
        """
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for layer in self.layers.values():
            layer.reset_slot(slot, generator=generator)

    def slot_config(self, slot: int) -> SlotConfig:
        return next(iter(self.layers.values())).slot_config(slot)

    def slot_named_parameters(self, slot: int) -> list[tuple[str, nn.Parameter]]:
        named = []
        for name, layer in self.slot_layers(slot).items():
            a, b = layer.slot_parameters(slot)
            named += [(f"{name}.lora_A", a), (f"{name}.lora_B", b)]
        return named

    def slot_parameters(self, slot: int) -> list[nn.Parameter]:
        return [p for _, p in self.slot_named_parameters(slot)]

    def slot_state_dict(self, slot: int) -> dict[str, Tensor]:
        """Detached copies sliced to the slot's rank: A (r, in), B (out, r)."""
        rank = self.slot_config(slot).rank
        state = {}
        for name, layer in self.slot_layers(slot).items():
            state[f"{name}.lora_A"] = layer.lora_A[slot][:rank].detach().clone()
            state[f"{name}.lora_B"] = layer.lora_B[slot][:, :rank].detach().clone()
        return state

    def load_slot_state_dict(self, slot: int, state: dict[str, Tensor]) -> None:
        """Load `slot_state_dict` output (configure the slot's rank first); strict on keys and shapes."""
        rank = self.slot_config(slot).rank
        layers = self.slot_layers(slot)
        expected = {key for name in layers for key in (f"{name}.lora_A", f"{name}.lora_B")}
        missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
        if missing or unexpected:
            raise KeyError(f"slot state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, layer in layers.items():
            a, b = state[f"{name}.lora_A"], state[f"{name}.lora_B"]
            if tuple(a.shape) != (rank, layer.in_features) or tuple(b.shape) != (layer.out_features, rank):
                raise ValueError(
                    f"{name}: expected lora_A {(rank, layer.in_features)} and lora_B "
                    f"{(layer.out_features, rank)} for rank {rank}, got {tuple(a.shape)} and {tuple(b.shape)}"
                )
        for name, layer in layers.items():
            pa, pb = layer.slot_parameters(slot)
            with torch.no_grad():
                pa.zero_()
                pa[:rank].copy_(state[f"{name}.lora_A"])
                pb.zero_()
                pb[:, :rank].copy_(state[f"{name}.lora_B"])
            pa.grad = None
            pb.grad = None

    def set_path(self, path: PathName) -> None:
        """Force the delta computation path of every layer (tests, benchmarks)."""
        _check_path(path)
        for layer in self.layers.values():
            layer.path = path


def apply_multi_lora(
    model: nn.Module,
    target_modules: Sequence[str],
    n_slots: int,
    max_rank: int,
    *,
    dropout: float = 0.0,
    dtype: torch.dtype | None = None,
    path: PathName = "auto",
) -> MultiLoRA:
    """Wrap every `nn.Linear` whose last name component is in `target_modules` (in place).

    Every base parameter of `model` is frozen; only the LoRA parameters train. Each slot starts
    as rank = alpha = max_rank with `dropout`, freshly initialised (the identity). Raises if a
    target name matches no linear layer (a typo would otherwise train nothing).

    ``dtype``: of the LoRA weights, hence of their gradients and optimizer state. By default
    `master_dtype` (as `MultiLoRALinear`): a bf16/fp16 base gets fp32 LoRA weights (master weights; the forward
    casts them to the activations' dtype, so the matmuls still run in bf16). Small updates to a bf16
    weight round away (8 significant bits), which is why the pool's bf16 default on CUDA needs this.
    """
    targets = tuple(dict.fromkeys(target_modules))
    if not targets:
        raise ValueError("target_modules is empty")
    if any(isinstance(m, MultiLoRALinear) for m in model.modules()):
        raise ValueError("model already has MultiLoRALinear layers")
    model.requires_grad_(False)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    unmatched = sorted(set(targets) - {name.rsplit(".", 1)[-1] for name, _ in found})
    if unmatched:
        raise ValueError(f"target_modules {unmatched} match no nn.Linear in {type(model).__name__}")
    context = SegmentContext()
    layers: dict[str, MultiLoRALinear] = {}
    for name, linear in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = MultiLoRALinear(
            linear,
            n_slots,
            max_rank,
            dropout=dropout,
            segment_context=context,
            dtype=dtype,
            path=path,
        )
        setattr(parent, child, wrapped)
        layers[name] = wrapped
    return MultiLoRA(
        model, layers, n_slots=n_slots, max_rank=max_rank, target_modules=targets, context=context
    )

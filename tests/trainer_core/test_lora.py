"""MultiLoRALinear / apply_multi_lora: the grouped and loop paths against a dense per-adapter
reference, identity of fresh slots, slot isolation, rank masking under AdamW, the segment context."""

import copy
from collections import Counter

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer_core.lora import (
    MultiLoRALinear,
    SegmentLayout,
    apply_multi_lora,
    grouped_mm_unsupported_reason,
)
from trainer_core.models.tiny import build_model

IN, OUT, N_SLOTS, MAX_RANK = 32, 48, 5, 8
RANKS = (8, 4, 2, 8, 1)
ALPHAS = (16.0, 4.0, 3.0, 8.0, 2.0)
# Mixed sizes, empty segments first, in the middle and last, and a single-segment layout.
COUNTS = [(3, 0, 7, 1, 0), (0, 12, 0, 0, 0), (0, 1, 2, 3, 5), (2, 2, 2, 2, 2), (11, 0, 0, 0, 0)]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_layer(dtype: torch.dtype = torch.float32, seed: int = 0) -> MultiLoRALinear:
    """A layer whose slots have mixed ranks and alphas and non-zero A and B (B random too)."""
    gen = torch.Generator().manual_seed(seed)
    base = nn.Linear(IN, OUT, dtype=dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(OUT, IN, generator=gen) * 0.2)
        base.bias.copy_(torch.randn(OUT, generator=gen))
    layer = MultiLoRALinear(base, N_SLOTS, MAX_RANK, dtype=dtype)  # bf16 parameters too, when asked
    for slot, (rank, alpha) in enumerate(zip(RANKS, ALPHAS, strict=True)):
        layer.configure_slot(slot, rank=rank, alpha=alpha)
        layer.reset_slot(slot, generator=gen)
        with torch.no_grad():
            layer.lora_B[slot][:, :rank].copy_(torch.randn(OUT, rank, generator=gen) * 0.3)
    return layer


def dense_reference(
    layer: MultiLoRALinear, x: Tensor, counts: tuple[int, ...]
) -> tuple[Tensor, list[Tensor]]:
    """Each segment with its own A_s, B_s explicitly, on leaf copies; returns (y, the copies)."""
    leaves = [
        p.detach().clone().requires_grad_(True) for s in range(N_SLOTS) for p in layer.slot_parameters(s)
    ]
    x2 = x.reshape(-1, IN)
    ys, start = [], 0
    for slot, n in enumerate(counts):
        if n == 0:
            continue  # no tokens: the slot must not even enter the graph (its gradient stays None)
        a, b = leaves[2 * slot], leaves[2 * slot + 1]
        rank, alpha = RANKS[slot], ALPHAS[slot]
        seg = x2[start : start + n]
        ys.append(layer.base(seg) + (alpha / rank) * seg @ a[:rank].T @ b[:, :rank].T)
        start += n
    return torch.cat(ys).reshape(*x.shape[:-1], OUT), leaves


def run_and_grads(layer: MultiLoRALinear, x: Tensor, counts: tuple[int, ...], path: str, upstream: Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x, counts, path=path)
    y.backward(upstream)
    grads = [p.grad for s in range(N_SLOTS) for p in layer.slot_parameters(s)]
    return y.detach(), x.grad, grads


def reference_and_grads(layer: MultiLoRALinear, x: Tensor, counts: tuple[int, ...], upstream: Tensor):
    x = x.detach().clone().requires_grad_(True)
    y, leaves = dense_reference(layer, x, counts)
    y.backward(upstream)
    return y.detach(), x.grad, [leaf.grad for leaf in leaves]


def assert_grads_close(
    got: list[Tensor | None], want: list[Tensor | None], *, rtol: float, atol: float
) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        # A slot without tokens gets no gradient at all, in the reference as in the layer.
        assert (g is None) == (w is None), f"parameter {i}: gradient presence differs"
        if g is not None and w is not None:

            def message(detail: str, i: int = i) -> str:
                return f"parameter {i}: {detail}"

            torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol, msg=message)


def paths_for(dtype: torch.dtype) -> list:
    """grouped where it runs here (skipped with the reason otherwise), loop, and auto."""
    reason = grouped_mm_unsupported_reason(torch.device("cpu"), dtype, (IN, OUT, MAX_RANK), for_auto=False)
    grouped = pytest.param("grouped", marks=pytest.mark.skipif(reason is not None, reason=str(reason)))
    return [grouped, "loop", "auto"]


@pytest.mark.parametrize("path", paths_for(torch.float32))
@pytest.mark.parametrize("counts", COUNTS)
def test_paths_match_dense_reference_fp32(path: str, counts: tuple[int, ...]) -> None:
    layer = make_layer()
    total = sum(counts)
    x = torch.randn(1, total, IN)
    upstream = torch.randn(1, total, OUT)
    y, gx, grads = run_and_grads(layer, x, counts, path, upstream)
    y_ref, gx_ref, grads_ref = reference_and_grads(layer, x, counts, upstream)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, grads_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_equals_loop_fp32(counts: tuple[int, ...]) -> None:
    reason = grouped_mm_unsupported_reason(
        torch.device("cpu"), torch.float32, (IN, OUT, MAX_RANK), for_auto=False
    )
    if reason:
        pytest.skip(reason)
    layer = make_layer()
    x = torch.randn(sum(counts), IN)  # 2D input: tokens already flat
    upstream = torch.randn(sum(counts), OUT)
    y_g, gx_g, grads_g = run_and_grads(layer, x, counts, "grouped", upstream)
    y_l, gx_l, grads_l = run_and_grads(layer, x, counts, "loop", upstream)
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_g, gx_l, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads_g, grads_l, rtol=1e-5, atol=1e-5)


# bf16 keeps 8 significant bits (relative step 2^-8 ≈ 3.9e-3); two chained matmuls and the rounding
# of h = x Aᵀ, of the scaled B and of the output add a few steps. Stated tolerance: the largest
# error is at most 2e-2 of the largest reference magnitude (measured: ≤ 6.5e-3), against a float32
# reference computed from the same bf16 inputs and weights.
BF16_REL_TOL = 2e-2


def assert_close_bf16(got: Tensor | None, want: Tensor | None, what: str) -> None:
    assert (got is None) == (want is None), f"{what}: gradient presence differs"
    if got is not None and want is not None:
        err = (got.float() - want).abs().max().item()
        assert err <= BF16_REL_TOL * want.abs().max().item() + 1e-6, f"{what}: max error {err}"


CUDA_PARAM = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
)


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
@pytest.mark.parametrize("path", ["grouped", "loop", "auto"])
@pytest.mark.parametrize("counts", COUNTS[:3])
def test_paths_match_reference_bf16(device: str, path: str, counts: tuple[int, ...]) -> None:
    reason = grouped_mm_unsupported_reason(
        torch.device(device), torch.bfloat16, (IN, OUT, MAX_RANK), for_auto=False
    )
    if path == "grouped" and reason:
        pytest.skip(reason)
    layer = make_layer(torch.bfloat16).to(device)
    ref_layer = make_layer(torch.bfloat16).float().to(device)  # the same bf16 values, computed in float32
    total = sum(counts)
    x = torch.randn(2, total, IN).to(device=device, dtype=torch.bfloat16)[:1]  # a batch slice, bf16
    upstream = torch.randn(1, total, OUT).to(device=device, dtype=torch.bfloat16)
    y, gx, grads = run_and_grads(layer, x, counts, path, upstream)
    y_ref, gx_ref, grads_ref = reference_and_grads(ref_layer, x.float(), counts, upstream.float())
    assert y.dtype == torch.bfloat16
    assert_close_bf16(y, y_ref, "output")
    assert_close_bf16(gx, gx_ref, "grad x")
    for i, (g, w) in enumerate(zip(grads, grads_ref, strict=True)):
        assert_close_bf16(g, w, f"grad of parameter {i}")


def test_auto_path_choice_on_cpu() -> None:
    dims = (IN, OUT, MAX_RANK)
    cpu = torch.device("cpu")
    # Documented choice in lora.py: grouped for fp32/bf16 on CPU where the kernel runs, loop otherwise.
    if grouped_mm_unsupported_reason(cpu, torch.float32, dims, for_auto=False) is None:
        assert grouped_mm_unsupported_reason(cpu, torch.float32, dims, for_auto=True) is None
    assert grouped_mm_unsupported_reason(cpu, torch.float64, dims, for_auto=True) is not None
    assert grouped_mm_unsupported_reason(cpu, torch.float16, dims, for_auto=True) is not None
    # Row strides that are not multiples of 16 bytes: the kernel refuses them.
    assert grouped_mm_unsupported_reason(cpu, torch.bfloat16, (IN, OUT, 4), for_auto=False) is not None


def test_forcing_grouped_where_it_cannot_run_is_a_clear_error() -> None:
    layer = MultiLoRALinear(nn.Linear(IN, OUT, dtype=torch.float64), 2, MAX_RANK)
    x = torch.randn(4, IN, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="path='grouped' cannot run"):
        layer(x, [2, 2], path="grouped")
    layer(x, [2, 2], path="auto")  # falls back to the loop


def test_fresh_slots_are_the_identity() -> None:
    base = nn.Linear(IN, OUT)
    layer = MultiLoRALinear(base, N_SLOTS, MAX_RANK)
    x = torch.randn(10, IN)
    for path in ("loop", "auto"):
        torch.testing.assert_close(layer(x, [2, 0, 3, 4, 1], path=path), base(x), rtol=0, atol=0)
    for slot in range(N_SLOTS):
        a, b = layer.slot_parameters(slot)
        assert torch.count_nonzero(b) == 0
        assert torch.count_nonzero(a) > 0  # Kaiming, so the first step already has a gradient for B


def test_fresh_model_is_the_base_model() -> None:
    model = build_model("llama", seed=0)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        want = model(ids).logits
    handle = apply_multi_lora(model, ALL_TARGETS, n_slots=3, max_rank=4)
    with torch.no_grad(), handle.segments([4, 0, 5]):
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reset_slot_leaves_other_slots_bit_identical() -> None:
    layer = make_layer()
    before = {s: [p.detach().clone() for p in layer.slot_parameters(s)] for s in range(N_SLOTS)}
    layer.reset_slot(2)
    for slot in range(N_SLOTS):
        if slot != 2:
            for p, q in zip(layer.slot_parameters(slot), before[slot], strict=True):
                assert torch.equal(p, q)
    a, b = layer.slot_parameters(2)
    rank = RANKS[2]
    assert torch.count_nonzero(b) == 0 and torch.count_nonzero(a[rank:]) == 0
    assert not torch.equal(a, before[2][0])
    bound = 1.0 / IN**0.5  # kaiming_uniform_(a=sqrt(5)), as LoRA / peft initialise A
    assert a[:rank].abs().max() <= bound


def test_handle_reset_slot_with_seed_depends_on_the_seed_only() -> None:
    handle = apply_multi_lora(build_model("qwen2", seed=0), ["q_proj", "v_proj"], n_slots=3, max_rank=4)
    handle.reset_slot(0, seed=7)
    torch.manual_seed(123)  # the global RNG must not matter
    handle.reset_slot(2, seed=7)
    first, third = handle.slot_state_dict(0), handle.slot_state_dict(2)
    assert all(torch.equal(first[k], third[k]) for k in first)


def test_reset_drops_the_slot_gradient_only() -> None:
    layer = make_layer()
    layer(torch.randn(6, IN), [2, 2, 2, 0, 0]).sum().backward()
    layer.reset_slot(1)
    assert all(p.grad is None for p in layer.slot_parameters(1))
    assert all(p.grad is not None for p in layer.slot_parameters(0) + layer.slot_parameters(2))


@pytest.mark.parametrize("path", paths_for(torch.float32))
def test_rank_below_max_stays_zero_under_adamw_with_weight_decay(path: str) -> None:
    layer = make_layer()
    slot, rank = 2, RANKS[2]
    a, b = layer.slot_parameters(slot)
    start = [a.detach().clone(), b.detach().clone()]
    opt = torch.optim.AdamW([a, b], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        opt.zero_grad()
        y = layer(torch.randn(12, IN), [3, 0, 6, 3, 0], path=path)
        (y**2).mean().backward()
        assert a.grad is not None and b.grad is not None
        # Exactly zero gradient beyond the rank: zero update from Adam, zero stays zero under decay.
        assert torch.count_nonzero(a.grad[rank:]) == 0 and torch.count_nonzero(b.grad[:, rank:]) == 0
        opt.step()
    assert torch.count_nonzero(a[rank:]) == 0 and torch.count_nonzero(b[:, rank:]) == 0
    assert not torch.equal(a[:rank], start[0][:rank]) and not torch.equal(b[:, :rank], start[1][:, :rank])


def test_configure_slot_to_a_lower_rank_zeroes_the_rest() -> None:
    layer = make_layer()
    layer.configure_slot(0, rank=3, alpha=6.0, dropout=0.1)
    a, b = layer.slot_parameters(0)
    assert torch.count_nonzero(a[3:]) == 0 and torch.count_nonzero(b[:, 3:]) == 0
    cfg = layer.slot_config(0)
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.scaling) == (3, 6.0, 0.1, 2.0)
    with pytest.raises(ValueError, match="rank"):
        layer.configure_slot(0, rank=MAX_RANK + 1, alpha=1.0)
    with pytest.raises(ValueError, match="dropout"):
        layer.configure_slot(0, rank=2, alpha=1.0, dropout=1.0)


def test_counts_are_checked() -> None:
    layer = make_layer()
    x = torch.randn(2, 3, IN)
    with pytest.raises(ValueError, match="sum to 5 but the input has 6 tokens"):
        layer(x, [1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="expected 5 slot token counts"):
        layer(x, [6])
    with pytest.raises(ValueError, match=">= 0"):
        layer(x, [7, -1, 0, 0, 0])
    # A counts tensor works like a list.
    torch.testing.assert_close(layer(x, torch.tensor([1, 2, 0, 3, 0])), layer(x, [1, 2, 0, 3, 0]))


def test_without_counts_or_context_the_output_is_the_base_output() -> None:
    layer = make_layer()
    x = torch.randn(4, IN)
    torch.testing.assert_close(layer(x), layer.base(x), rtol=0, atol=0)


def test_segment_context_is_set_only_inside_the_block() -> None:
    handle = apply_multi_lora(build_model("mistral", seed=0), ["q_proj"], n_slots=2, max_rank=4)
    assert handle.context.layout is None
    with handle.segments([1, 2]) as layout:
        assert handle.context.layout is layout and layout.active == (0, 1)
        with handle.segments([3, 0]):
            assert handle.context.layout.counts == (3, 0)
        assert handle.context.layout is layout
    assert handle.context.layout is None
    with pytest.raises(RuntimeError, match="boom"), handle.segments([1, 1]):
        raise RuntimeError("boom")
    assert handle.context.layout is None
    # Every layer shares the handle's context object.
    assert all(layer.segment_context is handle.context for layer in handle.layers.values())


def test_packed_batch_in_a_model_routes_each_row_to_its_slot() -> None:
    """Rows of a (3, L) batch on slots 0, 2, 3: each row's logits equal that row alone on its slot."""
    model = build_model("llama", seed=0)
    handle = apply_multi_lora(model, ALL_TARGETS, n_slots=4, max_rank=4)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for slot in range(4):
            for p in handle.slot_parameters(slot):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    ids = torch.randint(0, 256, (3, 7), generator=gen)
    with torch.no_grad(), handle.segments([7, 0, 7, 7]):
        packed = model(ids).logits
    for row, slot in enumerate((0, 2, 3)):
        counts = [0, 0, 0, 0]
        counts[slot] = 7
        with torch.no_grad(), handle.segments(counts):
            alone = model(ids[row : row + 1]).logits
        torch.testing.assert_close(packed[row : row + 1], alone, rtol=1e-5, atol=1e-5)


def test_gradients_reach_only_the_slots_with_tokens() -> None:
    model = build_model("qwen3", seed=0)
    handle = apply_multi_lora(model, ALL_TARGETS, n_slots=3, max_rank=4)
    ids = torch.randint(0, 256, (1, 8))
    with handle.segments([5, 0, 3]):
        model(ids).logits.square().mean().backward()
    # B = 0 in fresh slots, so A's gradient is zero, but B's is not; slot 1 is never touched.
    assert all(p.grad is not None for p in handle.slot_parameters(0) + handle.slot_parameters(2))
    assert all(p.grad is None for p in handle.slot_parameters(1))
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("path", paths_for(torch.float32))
def test_dropout_is_per_slot_and_training_only(path: str) -> None:
    layer = make_layer()
    layer.configure_slot(0, rank=RANKS[0], alpha=ALPHAS[0], dropout=0.5)  # slot 1 keeps dropout 0
    x = torch.randn(8, IN)
    counts = [4, 4, 0, 0, 0]
    layer.eval()
    y_eval = layer(x, counts, path=path)
    layer.train()
    torch.manual_seed(3)
    y_train = layer(x, counts, path=path)
    torch.testing.assert_close(y_train[4:], y_eval[4:])  # slot 1: no dropout
    assert not torch.allclose(y_train[:4], y_eval[:4])  # slot 0: dropped
    torch.manual_seed(3)
    torch.testing.assert_close(layer(x, counts, path="loop"), y_train, rtol=1e-5, atol=1e-5)


def test_apply_multi_lora_handle() -> None:
    model = build_model("qwen2", seed=0)
    handle = apply_multi_lora(model, ["q_proj", "v_proj", "down_proj"], n_slots=3, max_rank=8)
    assert sorted(handle.layers) == sorted(
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    )
    assert (handle.n_slots, handle.max_rank, handle.target_modules) == (
        3,
        8,
        ("q_proj", "v_proj", "down_proj"),
    )
    assert all(model.get_submodule(name) is layer for name, layer in handle.layers.items())
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, _ in model.named_parameters() if ".lora_" in n
    ]
    named = handle.slot_named_parameters(1)
    assert len(named) == 2 * len(handle.layers)
    assert named[0][0] == "model.layers.0.self_attn.q_proj.lora_A"
    assert [p for _, p in named] == handle.slot_parameters(1)
    assert {id(p) for p in handle.slot_parameters(1)}.isdisjoint(id(p) for p in handle.slot_parameters(2))

    handle.configure_slot(1, rank=3, alpha=6.0, dropout=0.05)
    assert handle.slot_config(1).rank == 3 and handle.slot_config(1).alpha == 6.0
    state = handle.slot_state_dict(1)
    assert state["model.layers.0.self_attn.q_proj.lora_A"].shape == (3, 64)
    assert state["model.layers.0.self_attn.v_proj.lora_B"].shape == (32, 3)  # 2 kv heads × 16
    state = {k: torch.randn_like(v) for k, v in state.items()}
    handle.load_slot_state_dict(1, state)
    assert all(torch.equal(v, handle.slot_state_dict(1)[k]) for k, v in state.items())
    with pytest.raises(KeyError, match="missing"):
        handle.load_slot_state_dict(1, dict(list(state.items())[1:]))
    handle.configure_slot(2, rank=2, alpha=1.0)
    with pytest.raises(ValueError, match="rank 2"):
        handle.load_slot_state_dict(2, state)


def test_apply_multi_lora_rejects_unknown_targets_and_double_application() -> None:
    model = build_model("llama", seed=0)
    with pytest.raises(ValueError, match="q_porj"):
        apply_multi_lora(model, ["q_proj", "q_porj"], n_slots=2, max_rank=4)
    apply_multi_lora(model, ["q_proj"], n_slots=2, max_rank=4)
    with pytest.raises(ValueError, match="already"):
        apply_multi_lora(model, ["v_proj"], n_slots=2, max_rank=4)


def test_segment_layout() -> None:
    layout = SegmentLayout.from_counts(torch.tensor([0, 3, 0, 2]), 4)
    assert (layout.active, layout.active_counts, layout.total) == ((1, 3), (3, 2), 5)
    assert layout.offsets(torch.device("cpu")).tolist() == [3, 5]
    with pytest.raises(TypeError):
        SegmentLayout.from_counts([1.5, 2], 2)  # type: ignore[list-item]  # the wrong type on purpose


# ---- the grouped path's own autograd node and the stacked slot storage ------------------------------

# Dispatcher ops that launch no kernel: views, allocations, and the graph's leaf bookkeeping.
_NO_KERNEL = {
    "view", "t", "transpose", "permute", "unsqueeze", "select", "unbind", "slice", "detach", "alias",
    "_unsafe_view", "expand", "lift_fresh", "empty", "empty_strided",
}  # fmt: skip


class _OpCounter(TorchDispatchMode):
    """Counts the dispatched ops that run a kernel (on CUDA, each is at least one launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops["mm" if name == "_grouped_mm" else name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_adapter_and_many_run_the_same_kernels(dtype: torch.dtype) -> None:
    """On the grouped path N adapters in one layer cost the kernels of one: no stacking, casting or
    scaling per slot (those launches made N = 8 cost ~1,200 more per pass than N = 1 on a GPU)."""
    if grouped_mm_unsupported_reason(torch.device("cpu"), dtype, (IN, OUT, MAX_RANK), for_auto=True):
        pytest.skip("no grouped kernel here")
    layer = make_layer(dtype)
    layer.lora_scaling.fill_(1.0)  # every slot at full rank: the op counts do not depend on it
    seen = {}
    for counts in [(16, 0, 0, 0, 0), (0, 0, 16, 0, 0), (3, 3, 3, 3, 4), (0, 5, 5, 6, 0)]:
        layout = SegmentLayout.from_counts(counts, N_SLOTS)
        x = torch.randn(16, IN, dtype=dtype, requires_grad=True)
        layer(x, counts, path="grouped").sum().backward()  # warm-up
        layer.zero_grad(set_to_none=True)
        counter = _OpCounter()
        with counter:
            layer(x, counts, path="grouped").sum().backward()
        seen[counts] = dict(counter.ops)
        if len(layout.active) > 1:
            assert layer.resolve_path(x.device, dtype, layout) == "grouped"  # what auto picks
    first = next(iter(seen.values()))
    for counts, ops in seen.items():
        assert ops == first, f"{counts}: {ops} != {first}"


def test_slot_parameters_live_in_one_stack_and_the_forward_follows_them() -> None:
    """Each slot's A and B are slices of one stack per factor, so an optimizer's in-place update is
    what the next forward reads; a parameter given new storage is picked up (the stack is rebuilt)."""
    layer = make_layer()
    counts = (3, 0, 7, 1, 4)
    x, upstream = torch.randn(15, IN), torch.randn(15, OUT)
    a0, a1 = layer.lora_A[0], layer.lora_A[1]
    assert a1.data_ptr() - a0.data_ptr() == a0.numel() * a0.element_size()  # adjacent in one stack
    with torch.no_grad():
        layer.lora_B[2].add_(0.25)  # in place, as the optimizer steps
    layer.lora_A[3].data = layer.lora_A[3].detach() * 2.0  # new storage
    y, gx, grads = run_and_grads(layer, x, counts, "grouped", upstream)
    y_ref, gx_ref, grads_ref = reference_and_grads(layer, x, counts, upstream)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, grads_ref, rtol=1e-5, atol=1e-5)
    a3 = layer.lora_A[3]
    assert a3.data_ptr() - layer.lora_A[2].data_ptr() == a3.numel() * a3.element_size()  # re-stacked


def test_module_to_re_stacks_and_stays_exact() -> None:
    """``module.to(...)`` gives every parameter new storage (here fp32 → fp64 → fp32); the grouped path
    re-stacks on its next forward and agrees with the loop."""
    layer = make_layer().to(torch.float64).to(torch.float32)
    with torch.no_grad():
        layer.lora_B[1].add_(0.5)  # an optimizer's in-place step, on the new storage
    counts = (3, 1, 7, 1, 4)
    x, upstream = torch.randn(16, IN), torch.randn(16, OUT)
    y_g, gx_g, grads_g = run_and_grads(layer, x, counts, "grouped", upstream)
    y_l, gx_l, grads_l = run_and_grads(layer, x, counts, "loop", upstream)
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_g, gx_l, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads_g, grads_l, rtol=1e-5, atol=1e-5)


def test_slot_state_dict_holds_only_its_slot() -> None:
    """The slots share one stack in memory; what leaves the layer for a run is a copy of its slice, so
    saving it cannot carry another tenant's weights along (torch.save writes whole storages)."""
    model = build_model("llama", seed=0)
    handle = apply_multi_lora(model, ["q_proj", "v_proj"], n_slots=3, max_rank=4)
    for key, tensor in handle.slot_state_dict(1).items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), key


def test_new_parameter_objects_are_read_and_trained() -> None:
    """``load_state_dict(assign=True)`` and ``lora_A[s] = Parameter(...)`` put new parameters in the
    lists: the grouped path reads them and their gradients reach them (not the replaced ones)."""
    layer = make_layer()
    state = {k: v * 3 for k, v in layer.state_dict().items()}
    layer.load_state_dict(state, assign=True)
    layer.lora_B[1] = nn.Parameter(layer.lora_B[1].detach() + 0.5 * (layer.lora_scaling[1] > 0))
    counts = (3, 1, 7, 1, 4)
    x, upstream = torch.randn(16, IN), torch.randn(16, OUT)
    y_g, gx_g, grads_g = run_and_grads(layer, x, counts, "grouped", upstream)
    y_l, gx_l, grads_l = run_and_grads(layer, x, counts, "loop", upstream)
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-5)
    assert all(g is not None for g in grads_g)  # on the parameters now in the lists
    assert_grads_close(grads_g, grads_l, rtol=1e-5, atol=1e-5)


def test_a_deep_copy_stacks_its_own_parameters() -> None:
    layer = copy.deepcopy(make_layer())
    layer.lora_A[0].data = torch.randn_like(layer.lora_A[0])
    counts = (3, 1, 7, 1, 4)
    x, upstream = torch.randn(16, IN), torch.randn(16, OUT)
    y_g, _, _ = run_and_grads(layer, x, counts, "grouped", upstream)
    y_l, _, _ = run_and_grads(layer, x, counts, "loop", upstream)
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-5)


def test_module_to_takes_the_stack_along() -> None:
    """No stale stack stays behind in the old dtype (or on the old device) after ``module.to``."""
    layer = make_layer().double()
    a0 = layer.lora_A[0]
    assert layer._stack_a.stack.dtype == torch.float64
    assert a0.data_ptr() == layer._stack_a.stack.data_ptr()


def test_a_disabled_slot_gets_no_gradient_on_the_grouped_path() -> None:
    layer = make_layer()
    layer.set_slot_enabled(2, False)
    _, _, grads = run_and_grads(layer, torch.randn(16, IN), (3, 1, 7, 1, 4), "grouped", torch.randn(16, OUT))
    assert grads[4] is None and grads[5] is None  # slot 2's A and B
    assert all(g is not None for i, g in enumerate(grads) if i not in (4, 5))

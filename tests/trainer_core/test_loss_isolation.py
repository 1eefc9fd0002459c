"""Runs of different losses in the same packed passes (DESIGN §4.1), through the pool's own `train_step`:

- the reference policy of the reference KL is the base model without any adapter (1e-6), computed in one
  no-grad forward per micro-batch however many of its runs ask for it (counted);
- run A (ppo + reference KL) trained beside B (cross_entropy with weights), C (cispo with a GAE critic)
  and D (token_is) gets the adapter it gets alone (1e-5, fp32), and C's value head too.

As in `test_isolation.py`, two data-parallel ranks are emulated by one step over both ranks' rows.
"""

import copy
from dataclasses import dataclass, field

import pytest
import torch

from contracts.run_config import AdvantageSettings, LossSettings, OptimSettings, SchedulerSettings
from contracts.wire import TrainingBatch, TrainingSample
from trainer_core import step as step_module
from trainer_core.critic import ValueHeads
from trainer_core.dist import World
from trainer_core.lora import apply_multi_lora
from trainer_core.modeling import forward_packed
from trainer_core.models.tiny import build_model
from trainer_core.optim import MultiRunOptimizer
from trainer_core.packing import Packer
from trainer_core.step import reference_logits, train_step

torch.set_num_threads(1)

N_SLOTS = 4
MAX_RANK = 8
SEQ_LEN = 48
VOCAB = 256
HIDDEN = 64
A_STEPS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class Spec:
    name: str
    loss: LossSettings
    advantage: AdvantageSettings = field(default_factory=AdvantageSettings)
    rank: int = 4
    alpha: float = 8.0
    batch_size: int = 3
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=5e-3))
    max_steps: int = 8
    weights: bool = False
    """Samples carry per-token `weights` (cross_entropy)."""
    rewards: bool = False
    """Samples carry a `reward` (GAE)."""


RUN_A = Spec("A", LossSettings(kind="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_ref_coef=0.1))
RUN_B = Spec(
    "B",
    LossSettings(kind="cross_entropy"),
    rank=8,
    alpha=4.0,
    batch_size=2,
    weights=True,
    optim=OptimSettings(lr=2e-2, max_grad_norm=0.1),
)
RUN_C = Spec(
    "C",
    LossSettings(kind="cispo", kl_ref_coef=0.05, kl_ref_estimator="k2", entropy_coef=0.01),
    AdvantageSettings(estimator="gae", gamma=0.95, lam=0.9, value_coef=0.5, value_clip=1.0),
    rank=2,
    alpha=2.0,
    batch_size=4,
    rewards=True,
    # lr as A's: at 1e-2 AdamW's normalisation lifts float noise (from rows of other lengths) on
    # near-zero gradient entries to ~1e-5 — a difference that shrinks with the lr, unlike a leak.
    optim=OptimSettings(lr=2e-3, weight_decay=0.1),
)
RUN_D = Spec("D", LossSettings(kind="token_is", kl_coef=0.05), batch_size=5)


def make_batch(spec: Spec, step: int) -> TrainingBatch:
    gen = torch.Generator().manual_seed(1000 * ord(spec.name) + step)
    examples = []
    for _ in range(spec.batch_size):
        n_prompt = int(torch.randint(2, 7, (), generator=gen))
        n_completion = int(torch.randint(3, 9, (), generator=gen))
        logprobs = (-5.55 + 0.05 * torch.randn(n_completion, generator=gen)).tolist()
        mask = [True] * n_completion
        mask[-1] = n_completion % 2 == 0
        examples.append(
            TrainingSample(
                prompt_ids=torch.randint(0, VOCAB, (n_prompt,), generator=gen).tolist(),
                prompt_mask=[False] * n_prompt,
                completion_ids=torch.randint(0, VOCAB, (n_completion,), generator=gen).tolist(),
                completion_mask=mask,
                completion_logprobs=logprobs,
                advantage=float(torch.randn((), generator=gen)),
                weights=torch.rand(n_completion, generator=gen).mul(2).tolist() if spec.weights else None,
                reward=float(torch.randn((), generator=gen)) if spec.rewards else None,
            )
        )
    return TrainingBatch(examples=examples, temperature=0.9, step=step)


@dataclass
class Outcome:
    adapters: dict[str, dict[str, torch.Tensor]]
    heads: dict[str, dict[str, torch.Tensor]]
    steps: dict[str, int]
    shared: int


def train(placement: dict[int, Spec], *, steps_of: str, n_steps: int = A_STEPS) -> Outcome:
    model = build_model("llama", seed=0, vocab_size=VOCAB, hidden_size=HIDDEN)
    lora = apply_multi_lora(model, TARGETS, N_SLOTS, MAX_RANK)
    heads = ValueHeads(N_SLOTS, HIDDEN)
    opt = MultiRunOptimizer(N_SLOTS)
    packer = Packer(n_slots=N_SLOTS, seq_len=SEQ_LEN, dp_world_size=2)
    for slot, spec in placement.items():
        lora.configure_slot(slot, rank=spec.rank, alpha=spec.alpha)
        lora.reset_slot(slot, seed=ord(spec.name))
        params = lora.slot_parameters(slot)
        if spec.advantage.estimator == "gae":
            heads.reset_slot(slot)
            params = params + heads.slot_parameters(slot)
        opt.create(slot, params, optim=spec.optim, scheduler=SchedulerSettings(), max_steps=spec.max_steps)
        packer.add_run(slot, batch_size=spec.batch_size)
        for step in range(spec.max_steps):
            packer.add_batch(slot, make_batch(spec, step), batch_id=step)
    slot_of = {spec.name: slot for slot, spec in placement.items()}
    steps = dict.fromkeys(slot_of, 0)
    shared = 0
    while steps[steps_of] < n_steps:
        packed = packer.pack(force=True)
        assert packed is not None, "ran out of data"
        rows = [mb for rank_rows in packed.micro_batches for mb in rank_rows]
        for mb in rows:
            counts = mb.slot_token_counts
            shared += int(not mb.is_filler and counts[slot_of[steps_of]] > 0 and (counts > 0).sum() > 1)
        result = train_step(
            model=model,
            lora=lora,
            optimizer=opt,
            micro_batches=rows,
            loss_settings={slot: spec.loss for slot, spec in placement.items()},
            completing=packer.take_ready(),
            world=World(),
            device=torch.device("cpu"),
            advantage_settings={slot: spec.advantage for slot, spec in placement.items()},
            value_heads=heads,
        )
        assert not result.nonfinite
        for slot in result.stepped:
            steps[placement[slot].name] += 1
    return Outcome(
        adapters={spec.name: lora.slot_state_dict(slot) for slot, spec in placement.items()},
        heads={
            spec.name: heads.slot_state_dict(slot)
            for slot, spec in placement.items()
            if spec.advantage.estimator == "gae"
        },
        steps=steps,
        shared=shared,
    )


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(float((got[k] - want[k]).abs().max()) for k in got)


# ------------------------------------------------------------------------------------ the reference


def _packed_rows(placement: dict[int, Spec]) -> list:
    packer = Packer(n_slots=N_SLOTS, seq_len=SEQ_LEN, dp_world_size=1)
    for slot, spec in placement.items():
        packer.add_run(slot, batch_size=spec.batch_size)
        packer.add_batch(slot, make_batch(spec, 0), batch_id=0)
    packed = packer.pack(force=True)
    assert packed is not None
    return [mb for rank_rows in packed.micro_batches for mb in rank_rows if not mb.is_filler]


def test_reference_logits_are_the_base_model_without_adapter():
    base = build_model("llama", seed=0, vocab_size=VOCAB, hidden_size=HIDDEN)
    model = copy.deepcopy(base)
    lora = apply_multi_lora(model, TARGETS, N_SLOTS, MAX_RANK)
    for slot in range(N_SLOTS):
        lora.configure_slot(slot, rank=4, alpha=8.0)
        lora.reset_slot(slot, seed=slot)
        with torch.no_grad():
            for p in lora.slot_parameters(slot):
                p.add_(0.05 * torch.randn_like(p))  # a non-zero adapter: the policy differs from the base
    for mb in _packed_rows({0: RUN_A, 1: RUN_B, 3: RUN_D}):
        want = forward_packed(base, mb).detach()
        got = reference_logits(model, mb)
        assert not got.requires_grad
        assert float((got - want).abs().max()) <= 1e-6
        with lora.segments(mb.slot_token_counts):
            policy = forward_packed(model, mb).detach()
        assert float((policy - want).abs().max()) > 1e-3  # not vacuous: the adapters do change the logits


def test_one_reference_forward_per_micro_batch_however_many_runs_ask(monkeypatch):
    calls: list[int] = []
    real = step_module.reference_logits

    def counting(model, mb):
        calls.append(mb.num_samples)
        return real(model, mb)

    monkeypatch.setattr(step_module, "reference_logits", counting)
    a2 = Spec("E", LossSettings(kind="token_is", kl_ref_coef=0.2, kl_ref_estimator="k1"))
    a3 = Spec("F", LossSettings(kind="cispo", kl_ref_coef=0.3))
    placement = {0: RUN_A, 1: a2, 2: a3, 3: RUN_B}  # three runs ask for the reference KL, B does not
    model = build_model("llama", seed=0, vocab_size=VOCAB, hidden_size=HIDDEN)
    lora = apply_multi_lora(model, TARGETS, N_SLOTS, MAX_RANK)
    opt = MultiRunOptimizer(N_SLOTS)
    for slot, spec in placement.items():
        lora.configure_slot(slot, rank=spec.rank, alpha=spec.alpha)
        opt.create(
            slot, lora.slot_parameters(slot), optim=spec.optim, scheduler=SchedulerSettings(), max_steps=8
        )
    rows = _packed_rows(placement)
    asking = [mb for mb in rows if {0, 1, 2} & set(mb.token_slots[mb.loss_mask].unique().tolist())]
    assert any(len({0, 1, 2} & set(mb.token_slots[mb.loss_mask].tolist())) > 1 for mb in asking)
    train_step(
        model=model,
        lora=lora,
        optimizer=opt,
        micro_batches=rows,
        loss_settings={slot: spec.loss for slot, spec in placement.items()},
        completing=[],
        world=World(),
        device=torch.device("cpu"),
    )
    assert len(calls) == len(asking)
    # Runs that do not ask cost nothing.
    calls.clear()
    only_b = _packed_rows({3: RUN_B})
    train_step(
        model=model,
        lora=lora,
        optimizer=opt,
        micro_batches=only_b,
        loss_settings={3: RUN_B.loss},
        completing=[],
        world=World(),
        device=torch.device("cpu"),
    )
    assert calls == []


# ------------------------------------------------------------------------------------ isolation


@pytest.fixture(scope="module")
def a_alone() -> Outcome:
    return train({0: RUN_A}, steps_of="A")


@pytest.fixture(scope="module")
def c_alone() -> Outcome:
    return train({0: RUN_C}, steps_of="C")


@pytest.mark.slow
def test_mixed_losses_a_beside_b_c_d_equals_a_alone(a_alone):
    together = train({0: RUN_B, 1: RUN_D, 2: RUN_A, 3: RUN_C}, steps_of="A")
    assert together.steps["A"] == A_STEPS and min(together.steps.values()) >= 1
    assert together.shared >= A_STEPS
    moved = max(float(v.abs().max()) for k, v in a_alone.adapters["A"].items() if k.endswith("lora_B"))
    assert moved > 1e-3
    assert _worst(together.adapters["A"], a_alone.adapters["A"]) <= 1e-5


@pytest.mark.slow
def test_mixed_losses_c_adapter_and_value_head_equal_c_alone(c_alone):
    together = train({0: RUN_A, 1: RUN_C, 2: RUN_B, 3: RUN_D}, steps_of="C")
    assert together.steps["C"] == A_STEPS and together.shared >= A_STEPS
    head = c_alone.heads["C"]
    assert float(head["value_head.weight"].abs().max()) > 1e-4  # the critic learned something
    assert _worst(together.heads["C"], head) <= 1e-5
    assert _worst(together.adapters["C"], c_alone.adapters["C"]) <= 1e-5


def test_sft_step_normalises_by_the_sum_of_weights():
    """Through `train_step`: a cross_entropy run's gradient is that of the weighted mean CE (sum of w·CE
    over the sum of w), the normaliser the optimizer divides by (its grad norm before clipping)."""
    spec = Spec(
        "S",
        LossSettings(kind="cross_entropy"),
        weights=True,
        batch_size=3,
        optim=OptimSettings(lr=1e-3, max_grad_norm=1e6),
    )

    def setup():
        model = build_model("llama", seed=0, vocab_size=VOCAB, hidden_size=HIDDEN)
        lora = apply_multi_lora(model, TARGETS, N_SLOTS, MAX_RANK)
        lora.configure_slot(1, rank=spec.rank, alpha=spec.alpha)
        lora.reset_slot(1, seed=1)
        with torch.no_grad():
            for p in lora.slot_parameters(1):
                p.add_(0.01)  # B != 0: both factors get a gradient
        return model, lora

    packer = Packer(n_slots=N_SLOTS, seq_len=SEQ_LEN, dp_world_size=1)
    packer.add_run(1, batch_size=spec.batch_size)
    batch = make_batch(spec, 0)
    packer.add_batch(1, batch, batch_id=0)
    packed = packer.pack(force=True)
    assert packed is not None
    rows = [mb for rank_rows in packed.micro_batches for mb in rank_rows if not mb.is_filler]

    model, lora = setup()
    opt = MultiRunOptimizer(N_SLOTS)
    opt.create(1, lora.slot_parameters(1), optim=spec.optim, scheduler=SchedulerSettings(), max_steps=8)
    result = train_step(
        model=model,
        lora=lora,
        optimizer=opt,
        micro_batches=rows,
        loss_settings={1: spec.loss},
        completing=packer.take_ready(),
        world=World(),
        device=torch.device("cpu"),
    )
    assert 1 in result.stepped

    model, lora = setup()
    total, weight_sum = torch.zeros(()), 0.0
    for mb in rows:
        with lora.segments(mb.slot_token_counts):
            logits = forward_packed(model, mb)
        lp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, mb.input_ids[1:, None]).squeeze(1)
        keep = mb.loss_mask[1:] & (mb.sample_ids[1:] == mb.sample_ids[:-1])
        w = mb.weights[1:] * keep
        total = total - (w * lp).sum()
        weight_sum += float(w.sum())
    (total / weight_sum).backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in lora.slot_parameters(1)]))
    assert result.stepped[1].grad_norm == pytest.approx(float(want), rel=1e-4)

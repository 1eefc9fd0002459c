"""DESIGN §4.1, the headline invariant: training run A next to other runs gives A the same adapter
as training A alone on the same batches; a run that turns NaN is evicted and A is unchanged.

Everything here is the real thing: the tiny Llama, `apply_multi_lora`, the `Packer` and the pool's
own training step, `trainer_core.step.train_step` (`forward_packed` with block-diagonal attention,
`rl_loss`, the per-run NaN isolation and `MultiRunOptimizer`). Two data-parallel ranks are emulated
in one process by handing both ranks' micro-batches to one step (the sum that a gradient all-reduce
would produce).
"""

from dataclasses import dataclass, field

import pytest
import torch

from contracts.run_config import LossSettings, OptimSettings, SchedulerSettings
from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.dist import World
from trainer_core.lora import apply_multi_lora
from trainer_core.models.tiny import build_model
from trainer_core.optim import MultiRunOptimizer
from trainer_core.packing import Packer
from trainer_core.step import train_step

torch.set_num_threads(1)

N_SLOTS = 4
MAX_RANK = 8
SEQ_LEN = 48
VOCAB = 256
A_STEPS = 5


@dataclass
class RunSpec:
    """One run of the scenario: its config and how its batches are made."""

    name: str
    """Seeds its data and its adapter init: the same name gives the same run in any slot."""
    rank: int
    alpha: float
    batch_size: int
    optim: OptimSettings
    scheduler: SchedulerSettings
    max_steps: int
    loss: LossSettings = field(default_factory=LossSettings)
    temperature: float = 1.0
    advantage_scale: float = 1.0
    poison_step: int | None = None
    """Step whose batch gets a NaN inference logprob (the run must be evicted)."""


RUN_A = RunSpec(
    name="A",
    rank=4,
    alpha=8.0,
    batch_size=4,
    optim=OptimSettings(lr=2e-3, betas=(0.9, 0.99), weight_decay=0.01, max_grad_norm=1.0),
    scheduler=SchedulerSettings(kind="cosine", warmup_steps=1, min_lr_ratio=0.1),
    max_steps=A_STEPS,
    loss=LossSettings(kind="token_is", kl_coef=0.05),
    temperature=0.8,
)
RUN_B = RunSpec(
    name="B",
    rank=8,
    alpha=4.0,
    batch_size=3,
    optim=OptimSettings(lr=5e-2, max_grad_norm=0.1),
    scheduler=SchedulerSettings(kind="linear", warmup_steps=2),
    max_steps=8,
    loss=LossSettings(kind="sequence_is"),
    advantage_scale=1e4,  # a gradient 1e4 times larger than A's
)
RUN_C = RunSpec(
    name="C",
    rank=2,
    alpha=2.0,
    batch_size=5,
    optim=OptimSettings(lr=1e-2, weight_decay=0.1),
    scheduler=SchedulerSettings(kind="constant"),
    max_steps=8,
    temperature=1.2,
)


def make_batch(spec: RunSpec, step: int) -> TrainingBatch:
    """The run's rollout batch of a step: a function of (run name, step) only."""
    gen = torch.Generator().manual_seed(1000 * ord(spec.name) + step)
    examples = []
    for i in range(spec.batch_size):
        n_prompt = int(torch.randint(2, 7, (), generator=gen))
        n_completion = int(torch.randint(3, 9, (), generator=gen))
        # Near the tiny model's own logprobs (about -log 256), so ratios stay near 1: no token sits
        # at a masking boundary where float noise could flip it.
        logprobs = (-5.55 + 0.05 * torch.randn(n_completion, generator=gen)).tolist()
        if spec.poison_step == step and i == 1:
            logprobs[2] = float("nan")
        mask = [True] * n_completion
        mask[-1] = n_completion % 2 == 0  # some completion tokens carry no loss
        examples.append(
            TrainingSample(
                prompt_ids=torch.randint(0, VOCAB, (n_prompt,), generator=gen).tolist(),
                prompt_mask=[False] * n_prompt,
                completion_ids=torch.randint(0, VOCAB, (n_completion,), generator=gen).tolist(),
                completion_mask=mask,
                completion_logprobs=logprobs,
                advantage=float(torch.randn((), generator=gen)) * spec.advantage_scale,
            )
        )
    return TrainingBatch(examples=examples, temperature=spec.temperature, step=step)


@dataclass
class Outcome:
    adapters: dict[str, dict[str, torch.Tensor]]
    """Final adapter of every run that was not evicted."""
    steps: dict[str, int]
    evicted: list[str]
    shared_micro_batches: int
    """Micro-batches that held A's tokens together with another run's."""


def train(
    placement: dict[int, RunSpec],
    *,
    steps_of: str = "A",
    n_steps: int = A_STEPS,
    diverged_adapter: str | None = None,
) -> Outcome:
    """Train the runs in their slots until run ``steps_of`` has completed ``n_steps`` steps.

    ``diverged_adapter``: that run's adapter is made to overflow before the first step (its o_proj B
    set to Inf within its rank): finite inputs, non-finite activations and gradients of its own."""
    model = build_model("llama", seed=0, vocab_size=VOCAB)
    lora = apply_multi_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], N_SLOTS, MAX_RANK)
    opt = MultiRunOptimizer(N_SLOTS)
    packer = Packer(n_slots=N_SLOTS, seq_len=SEQ_LEN, dp_world_size=2)
    for slot, spec in placement.items():
        lora.configure_slot(slot, rank=spec.rank, alpha=spec.alpha)
        lora.reset_slot(slot, seed=ord(spec.name))  # the init depends on the run, not the slot
        opt.create(
            slot,
            lora.slot_parameters(slot),
            optim=spec.optim,
            scheduler=spec.scheduler,
            max_steps=spec.max_steps,
        )
        packer.add_run(slot, batch_size=spec.batch_size)
        for step in range(spec.max_steps):
            packer.add_batch(slot, make_batch(spec, step), batch_id=step)
    slot_of = {spec.name: slot for slot, spec in placement.items()}
    if diverged_adapter is not None:
        slot, rank = slot_of[diverged_adapter], placement[slot_of[diverged_adapter]].rank
        with torch.no_grad():
            for name, layer in lora.layers.items():
                if name.endswith("o_proj"):
                    layer.lora_B[slot][:, :rank].fill_(float("inf"))
    active = dict(placement)
    steps = dict.fromkeys(slot_of, 0)
    evicted: list[str] = []
    shared = 0

    while steps[steps_of] < n_steps:
        packed = packer.pack(force=True)
        assert packed is not None, "ran out of data"
        both_ranks = [mb for rank_rows in packed.micro_batches for mb in rank_rows]
        for mb in both_ranks:
            counts = mb.slot_token_counts
            shared += int(not mb.is_filler and counts[slot_of[steps_of]] > 0 and (counts > 0).sum() > 1)
        result = train_step(
            model=model,
            lora=lora,
            optimizer=opt,
            micro_batches=both_ranks,
            loss_settings={slot: spec.loss for slot, spec in active.items()},
            completing=[s for s in packer.take_ready() if s in active],
            world=World(),
            device=torch.device("cpu"),
        )
        for slot in sorted(result.nonfinite):
            # Eviction as the worker does it: the run leaves, its slot is reset.
            evicted.append(active.pop(slot).name)
            opt.remove(slot)
            lora.reset_slot(slot)
            packer.remove_run(slot)
        for slot, st in result.stepped.items():
            assert not st.nonfinite
            steps[active[slot].name] += 1

    return Outcome(
        adapters={spec.name: lora.slot_state_dict(slot) for slot, spec in active.items()},
        steps=steps,
        evicted=evicted,
        shared_micro_batches=shared,
    )


def assert_adapters_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-5
) -> None:
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in got)
    assert worst <= atol, f"A's adapter differs by {worst:.3g} (> {atol})"


@pytest.fixture(scope="module")
def alone() -> Outcome:
    return train({0: RUN_A})


@pytest.mark.slow
def test_a_trained_with_others_equals_a_trained_alone(alone):
    # A in another slot, between B (1e4 x gradients, other rank/lr/schedule/batch size) and C.
    together = train({0: RUN_B, 2: RUN_A, 3: RUN_C})
    assert together.steps["A"] == A_STEPS and together.evicted == []
    assert together.shared_micro_batches >= A_STEPS  # A really shared micro-batches with B and C
    assert together.steps["B"] >= 2 and together.steps["C"] >= 2

    # Not vacuous: A moved away from its (identity) init, and A's result is A's alone.
    init = {k: v for k, v in alone.adapters["A"].items() if k.endswith("lora_B")}
    assert max(float(v.abs().max()) for v in init.values()) > 1e-3
    assert_adapters_close(together.adapters["A"], alone.adapters["A"])


@pytest.mark.slow
def test_a_run_turning_nan_is_evicted_and_a_is_unchanged(alone):
    poisoned = RunSpec(**{**RUN_C.__dict__, "name": "C", "poison_step": 1})
    together = train({1: RUN_A, 2: poisoned, 3: RUN_B})
    assert together.evicted == ["C"]
    assert together.steps["C"] == 1  # its first step went through; the NaN one never stepped
    assert together.steps["A"] == A_STEPS
    assert_adapters_close(together.adapters["A"], alone.adapters["A"])


@pytest.mark.slow
def test_a_run_whose_adapter_diverges_is_evicted_alone(alone):
    """C's adapter overflows in its own forward. In a shared micro-batch its LoRA gradients are NaN even
    when only A's loss is back-propagated (0 x Inf), so judging every run's gradients on A's re-run
    evicted A too; each re-run now judges the run's own gradients only."""
    together = train({0: RUN_A, 1: RUN_C}, diverged_adapter="C")
    assert together.evicted == ["C"]
    assert together.shared_micro_batches >= 1
    assert together.steps["A"] == A_STEPS
    assert_adapters_close(together.adapters["A"], alone.adapters["A"])

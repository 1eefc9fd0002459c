"""The pool's sample requests (trainer_core.sample_server): an older saved step samples its own
weights from a borrowed free slot while the live slots (weights, accumulated gradients) stay as
they were, and the borrowed slot is reset after the call; what cannot be served fails by itself."""

import torch

from contracts.progress import Progress
from contracts.run_config import LoraSettings, RunConfig
from contracts.tinker_work import ManualWorkItem, SamplingSpec
from tests.trainer_core.test_sampling import full_forward_logprobs, tiny_model
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.sample_server import SampleServer, save_sampler_weights
from trainer_core.slots import RunSlot

CONFIG = RunConfig(lora=LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")))


def _item(request_id: str, step: int, prompt: list[int]) -> ManualWorkItem:
    spec = SamplingSpec(
        prompt=prompt, num_samples=2, max_tokens=5, temperature=1.0, top_k=-1, top_p=1.0, seed=3, step=step
    )
    return ManualWorkItem(request_id=request_id, run_id="run_a", seq_id=0, kind="sample", sampling=spec)


def test_an_older_step_samples_its_saved_weights_and_the_live_slot_is_untouched(tmp_path):
    model, lora = tiny_model(PACKED_ATTENTION)
    run = RunSlot(0, "run_a", CONFIG, Progress(step=1))
    save_sampler_weights(tmp_path, run, lora)
    step1 = {k: v.clone() for k, v in lora.slot_state_dict(0).items()}
    # The run trains on: new weights at step 2, and gradients accumulating for step 3.
    with torch.no_grad():
        for p in lora.slot_parameters(0):
            p.add_(0.2)
    for p in lora.slot_parameters(0):
        p.grad = torch.full_like(p, 0.5)
    run.progress.step = 2
    live_before = [p.detach().clone() for p in lora.slot_parameters(0)]
    other_before = [p.detach().clone() for p in lora.slot_parameters(1)]

    server = SampleServer(tmp_path)
    results = server.serve(
        model,
        lora,
        [(0, _item("old", 1, [5, 6, 7]), 0), (1, _item("new", 2, [8, 9]), 0)],
        {0: run, 1: RunSlot(1, "run_b", CONFIG, Progress(step=5))},
    )

    # The live slot and the other tenants' slots: as they were, gradients included.
    for p, before in zip(lora.slot_parameters(0), live_before, strict=True):
        assert torch.equal(p.detach(), before) and p.grad is not None and torch.all(p.grad == 0.5)
    for p, before in zip(lora.slot_parameters(1), other_before, strict=True):
        assert torch.equal(p.detach(), before)
    # The borrowed slot (the highest free one) is back to a fresh adapter: B = 0.
    assert all(torch.all(layer.lora_B[3] == 0) for layer in lora.layers.values())

    # The old request's logprobs are a forward of step 1's weights, the new one's of step 2's.
    lora.configure_slot(2, rank=4, alpha=8.0, target_modules=CONFIG.lora.target_modules)
    lora.load_slot_state_dict(2, step1)
    for index, slot in ((0, 2), (1, 0)):
        result = results[index]
        assert result.error is None and result.sequences is not None and len(result.sequences) == 2
        prompt = [5, 6, 7] if index == 0 else [8, 9]
        for seq in result.sequences:
            expected = full_forward_logprobs(model, lora, slot, prompt + seq.tokens)[-len(seq.tokens) :]
            torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=0)
    assert server.passes == 1  # both requests in one generation pass


def test_what_cannot_be_served_fails_alone(tmp_path):
    model, lora = tiny_model(PACKED_ATTENTION)
    run = RunSlot(0, "run_a", CONFIG, Progress(step=3))
    save_sampler_weights(tmp_path, run, lora)
    full = {s: RunSlot(s, f"run_{s}", CONFIG, Progress(step=3)) for s in range(1, lora.n_slots)} | {0: run}
    server = SampleServer(tmp_path)
    results = server.serve(
        model,
        lora,
        [(0, _item("gone", 1, [5]), 0), (1, _item("old", 3, [5]), 0)],
        {0: RunSlot(0, "run_a", CONFIG, Progress(step=4))} | {s: full[s] for s in range(1, lora.n_slots)},
    )
    assert results[0].error is not None and "not kept on this pool" in results[0].error
    assert results[1].error is not None and "no free adapter slot" in results[1].error
    # A request the pool can serve still is, beside those that fail.
    results = server.serve(
        model, lora, [(0, _item("gone", 1, [5]), 0), (1, _item("live", 3, [5]), 0)], {0: run}
    )
    assert results[0].error is not None and results[1].error is None and results[1].sequences


def test_a_later_save_at_the_same_step_replaces_the_kept_copy(tmp_path):
    """After a load_weights the slot may hold other weights at a step number already saved: the
    newest save is what that step's sampling clients get."""
    model, lora = tiny_model(PACKED_ATTENTION)
    run = RunSlot(0, "run_a", CONFIG, Progress(step=2))
    save_sampler_weights(tmp_path, run, lora)
    with torch.no_grad():
        for p in lora.slot_parameters(0):
            p.mul_(-1.0)
    save_sampler_weights(tmp_path, run, lora)
    kept = {k: v.clone() for k, v in lora.slot_state_dict(0).items()}
    run.progress.step = 3  # the run moves on: step 2 is served from the kept copy
    result = SampleServer(tmp_path).serve(model, lora, [(0, _item("old", 2, [5, 6]), 0)], {0: run})[0]
    assert result.sequences is not None
    lora.configure_slot(1, rank=4, alpha=8.0, target_modules=CONFIG.lora.target_modules)
    lora.load_slot_state_dict(1, kept)
    for seq in result.sequences:
        expected = full_forward_logprobs(model, lora, 1, [5, 6] + seq.tokens)[-len(seq.tokens) :]
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=0)


def test_sampling_leaves_the_global_rng_alone(tmp_path):
    """Training draws from the global RNG (dropout, unseeded inits): a sample request without a seed,
    or one that borrows a slot, must not reseed or advance it."""
    model, lora = tiny_model(PACKED_ATTENTION)
    run = RunSlot(0, "run_a", CONFIG, Progress(step=1))
    save_sampler_weights(tmp_path, run, lora)
    run.progress.step = 2
    unseeded = _item("new", 2, [5, 6])
    assert unseeded.sampling is not None
    unseeded.sampling.seed = None
    state = torch.get_rng_state()
    results = SampleServer(tmp_path).serve(
        model, lora, [(0, unseeded, 0), (1, _item("old", 1, [7]), 0)], {0: run}
    )
    assert all(r.error is None for r in results.values())
    assert torch.equal(torch.get_rng_state(), state)


def test_a_prompt_token_past_the_embeddings_fails_its_request_only(tmp_path):
    model, lora = tiny_model(PACKED_ATTENTION)
    run = RunSlot(0, "run_a", CONFIG, Progress(step=1))
    results = SampleServer(tmp_path).serve(
        model, lora, [(0, _item("bad", 1, [5, 96]), 0), (1, _item("good", 1, [5, 95]), 0)], {0: run}
    )
    assert results[0].error is not None and "outside the vocabulary [0, 96)" in results[0].error
    assert results[1].error is None and results[1].sequences


def test_stop_at_eos_ends_at_the_models_eos_and_without_it_runs_to_max_tokens(tmp_path):
    model, lora = tiny_model(PACKED_ATTENTION)
    run = RunSlot(0, "run_a", CONFIG, Progress(step=1))
    server = SampleServer(tmp_path)

    def greedy(stop_at_eos: bool) -> list[int]:
        item = _item("g", 1, [5, 6, 7])
        assert item.sampling is not None
        item.sampling.temperature, item.sampling.max_tokens, item.sampling.stop_at_eos = 0.0, 8, stop_at_eos
        result = server.serve(model, lora, [(0, item, 0)], {0: run})[0]
        assert result.sequences is not None
        return result.sequences[0].tokens

    tokens = greedy(False)
    eos = tokens[2]
    model.config.eos_token_id = model.generation_config.eos_token_id = eos  # the model's own EOS id
    assert greedy(False) == tokens  # stop=[]: no EOS stopping
    assert greedy(True) == tokens[: tokens.index(eos) + 1]

"""LocalSampler with a tiny random LlamaForCausalLM (vocab = the char tokenizer's) and
PEFT adapters saved locally: the reported logprobs are those the trainer recomputes."""

from __future__ import annotations

import copy
from pathlib import Path

import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from contracts.tokenizer import CharTokenizer
from orchestrator.engine import AgentPolicy, EngineConfig, MultiAgentEngine, Specialization
from orchestrator.samplers.local import LocalSampler, sample_tokens

TOK = CharTokenizer()


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TOK.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=TOK.bos_token_id,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


def save_adapter(base: LlamaForCausalLM, path: Path, seed: int) -> torch.nn.Module:
    """A LoRA adapter with random (non-identity) weights, saved as PEFT files; returns the reference model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    model.save_pretrained(str(path))
    return model.eval()


@torch.inference_mode()
def recomputed_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    """What the trainer computes: one unpadded forward pass over prompt + completion, logits / T."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


PROMPTS = [
    TOK.encode("12+7=", add_bos=True),
    TOK.encode("3+4=", add_bos=True),
    TOK.encode("1=", add_bos=True),
]


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    return tiny_llama()


def test_logprobs_match_the_trainers_recomputation(base: LlamaForCausalLM) -> None:
    sampler = LocalSampler(copy.deepcopy(base), eos_token_id=TOK.eos_token_id, seed=0, decode=TOK.decode)
    out = sampler.generate_sync(PROMPTS, n=2, max_tokens=6, temperature=0.7, top_p=0.9)
    assert len(out) == 6
    for k, completion in enumerate(out):
        prompt = PROMPTS[k // 2]
        assert 1 <= len(completion.token_ids) <= 6 and completion.text == TOK.decode(completion.token_ids)
        # Left padding + KV cache in a batch of different lengths gives the unpadded result.
        assert completion.logprobs == pytest.approx(
            recomputed_logprobs(base, prompt, completion.token_ids, 0.7), abs=1e-4
        )


def test_generation_uses_the_kv_cache_argument_transformers_expects(
    base: LlamaForCausalLM, recwarn: pytest.WarningsRecorder
) -> None:
    """transformers 5 renamed `past_key_values` to `cache`: passing the old name cost a FutureWarning
    per forward pass, printed between the demo's progress bars."""
    sampler = LocalSampler(copy.deepcopy(base), eos_token_id=TOK.eos_token_id, seed=0)
    out = sampler.generate_sync(PROMPTS, n=2, max_tokens=4, temperature=1.0, stop_token_ids=[])
    assert all(len(c.token_ids) == 4 for c in out)
    assert [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)] == []


def test_stop_tokens_end_a_completion(base: LlamaForCausalLM) -> None:
    sampler = LocalSampler(copy.deepcopy(base), seed=1)
    every_token = list(range(TOK.vocab_size))
    out = sampler.generate_sync(PROMPTS[:2], n=3, max_tokens=5, stop_token_ids=every_token)
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in out)
    out = sampler.generate_sync(PROMPTS[:1], n=1, max_tokens=3, stop_token_ids=[])
    assert len(out[0].token_ids) == 3 and out[0].finish_reason == "length"


def test_greedy_and_tiny_top_p_pick_the_argmax(base: LlamaForCausalLM) -> None:
    sampler = LocalSampler(copy.deepcopy(base), seed=2)
    greedy = sampler.generate_sync(PROMPTS, n=2, max_tokens=4, temperature=0.0, stop_token_ids=[])
    nucleus = sampler.generate_sync(
        PROMPTS, n=2, max_tokens=4, temperature=1.0, top_p=1e-6, stop_token_ids=[]
    )
    assert [c.token_ids for c in greedy] == [c.token_ids for c in nucleus]
    assert greedy[0].token_ids == greedy[1].token_ids
    # The reported logprob ignores the top-p truncation: it is the full T=1 distribution's.
    for k, c in enumerate(nucleus):
        assert c.logprobs == pytest.approx(
            recomputed_logprobs(base, PROMPTS[k // 2], c.token_ids, 1.0), abs=1e-4
        )
        assert all(lp < 0 for lp in c.logprobs)


def test_sample_tokens_top_p_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample_tokens(logits, 1.0, 0.7, gen)[0]) for _ in range(200)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are cut
    tokens, logprobs = sample_tokens(logits, 1.0, 0.7, gen)
    assert float(logprobs[0]) == pytest.approx(
        float(torch.log(torch.tensor([0.5, 0.3]))[int(tokens[0])]), abs=1e-6
    )


async def test_load_adapter_from_a_peft_directory(base: LlamaForCausalLM, tmp_path: Path) -> None:
    reference_1 = save_adapter(base, tmp_path / "step_1", seed=11)
    reference_2 = save_adapter(base, tmp_path / "step_2", seed=12)
    sampler = LocalSampler(copy.deepcopy(base), eos_token_id=TOK.eos_token_id, seed=3)

    await sampler.load_adapter(tmp_path / "step_1", "run_x-step-1", 1)
    out = await sampler.generate(PROMPTS[:2], n=2, max_tokens=5, temperature=1.0)
    for k, c in enumerate(out):
        expected = recomputed_logprobs(reference_1, PROMPTS[k // 2], c.token_ids, 1.0)
        assert c.logprobs == pytest.approx(expected, abs=1e-4)
        assert c.logprobs != pytest.approx(
            recomputed_logprobs(base, PROMPTS[k // 2], c.token_ids, 1.0), abs=1e-3
        )

    await sampler.load_adapter(tmp_path / "step_2", "run_x-step-2", 2)  # swapped, not stacked
    assert (sampler.adapter_name, sampler.adapter_step) == ("run_x-step-2", 2)
    assert len(sampler.model.peft_config) == 1
    out = await sampler.generate(PROMPTS[:1], n=2, max_tokens=5, temperature=1.0)
    for c in out:
        assert c.logprobs == pytest.approx(
            recomputed_logprobs(reference_2, PROMPTS[0], c.token_ids, 1.0), abs=1e-4
        )

    with pytest.raises(FileNotFoundError):
        await sampler.load_adapter(tmp_path / "missing", "nope", 3)


async def test_engine_rollouts_with_a_local_sampler(base: LlamaForCausalLM) -> None:
    sampler = LocalSampler(copy.deepcopy(base), eos_token_id=TOK.eos_token_id, seed=4)
    engine = MultiAgentEngine(
        EngineConfig(
            env="solver_checker",
            specialization=Specialization.PROMPT,
            problems_per_step=2,
            samples_per_problem=3,
        ),
        {
            "solver": AgentPolicy(run_id="run_aaaaaaaaaaaa", sampler=sampler, tokenizer=TOK),
            "checker": AgentPolicy(run_id="run_aaaaaaaaaaaa", sampler=sampler, tokenizer=TOK),
        },
    )
    batch = engine.make_batches(await engine.generate(step=0))["run_aaaaaaaaaaaa"].batch
    assert batch is not None and len(batch.examples) == 12
    for sample in batch.examples[:4]:
        assert sample.completion_logprobs == pytest.approx(
            recomputed_logprobs(base, sample.prompt_ids, sample.completion_ids, 1.0), abs=1e-4
        )

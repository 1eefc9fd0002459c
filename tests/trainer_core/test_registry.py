"""Base models by name: a locally saved model loads by path (the hub-id path users take)."""

import pytest
import torch

from trainer_core.models.registry import load_base_model
from trainer_core.models.tiny import build_model


def test_local_path_loads_frozen_and_identical(tmp_path):
    saved = build_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1)
    saved.save_pretrained(tmp_path / "my-model")

    loaded = load_base_model(str(tmp_path / "my-model"))

    assert all(not p.requires_grad for p in loaded.parameters())
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded(ids).logits, saved(ids).logits, rtol=0, atol=1e-6)


def test_builtin_tiny_model_matches_the_sdk_tokenizer(tmp_path):
    from contracts.tokenizer import CharTokenizer

    model = load_base_model("loraloom-tiny", cache_dir=tmp_path)
    assert model.config.vocab_size == CharTokenizer().vocab_size
    again = load_base_model("loraloom-tiny", cache_dir=tmp_path)  # from the cache, identical
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_mistyped_local_path_says_the_directory_does_not_exist(tmp_path) -> None:
    from trainer_core.models.registry import load_base_model, looks_local

    assert looks_local("./models/x") and looks_local("/abs/x") and looks_local("a/b/c")
    assert not looks_local("org/name") and not looks_local("loraloom-tiny")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_base_model(str(tmp_path / "no-such-model"))

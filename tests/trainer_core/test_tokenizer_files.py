"""The built-in character tokenizer as Hugging Face files: `AutoTokenizer` loads them offline and
encodes and decodes exactly as `CharTokenizer`; the built-in model's directory holds them too."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from contracts.tokenizer import CHARACTERS, CharTokenizer
from contracts.tokenizer_files import TOKENIZER_FILE, save_char_tokenizer
from tests.e2e.helpers import MODEL_CACHE
from trainer_core.models import builtin


def test_autotokenizer_reads_the_files_as_the_char_tokenizer(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    chars = CharTokenizer()
    tokenizer = AutoTokenizer.from_pretrained(str(save_char_tokenizer(tmp_path / "tok")))
    assert len(tokenizer) == chars.vocab_size
    every = CHARACTERS + CHARACTERS[::-1]  # every character, newline and space included
    ids = tokenizer.encode(every, add_special_tokens=False)
    assert ids == chars.encode(every)
    assert tokenizer.decode(ids) == every
    # An unknown character is <unk>, as in CharTokenizer.
    assert tokenizer.encode("1é2", add_special_tokens=False) == chars.encode("1é2") == [5, 3, 6]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    # Written again: the same files, nothing to replace.
    before = (tmp_path / "tok" / TOKENIZER_FILE).stat().st_mtime_ns
    save_char_tokenizer(tmp_path / "tok")
    assert (tmp_path / "tok" / TOKENIZER_FILE).stat().st_mtime_ns == before


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_the_built_model_directory_holds_its_tokenizer(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    builtin.load(MODEL_CACHE)
    tokenizer = AutoTokenizer.from_pretrained(str(builtin.cached_path(MODEL_CACHE)))
    assert tokenizer.encode("3+4=7", add_special_tokens=False) == CharTokenizer().encode("3+4=7")

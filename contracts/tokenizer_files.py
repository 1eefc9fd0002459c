"""The built-in character tokenizer as Hugging Face tokenizer files (`tokenizer.json` and
`tokenizer_config.json`), so that `AutoTokenizer.from_pretrained(directory)` loads it offline: the
Tinker SDK's `get_tokenizer()` does exactly that with the `tokenizer_id` of `get_info`.

Plain JSON, written without `tokenizers` or `transformers` (the service has neither to hand): a
WordLevel model over the vocabulary of `CharTokenizer` (same ids), a pre-tokenizer that isolates
every character, and a Fuse decoder that joins them back without spaces. Special tokens are
PAD/BOS/EOS/UNK at ids 0-3; no BOS or EOS is added on encode, as `CharTokenizer.encode`.
"""

import json
from pathlib import Path
from typing import Any

from contracts.durable import atomic_write_text
from contracts.tokenizer import BOS, EOS, PAD, UNK, CharTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def char_tokenizer_files(tokenizer: CharTokenizer) -> dict[str, str]:
    """File name -> content of the Hugging Face form of `tokenizer`."""
    vocab = {tokenizer.id_to_token(i): i for i in range(tokenizer.vocab_size)}
    specials = (PAD, BOS, EOS, UNK)
    spec: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": vocab[token],
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for token in specials
        ],
        "normalizer": None,
        # `[\s\S]`, not `.`: a dot would not match the newline, which is a token of its own.
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": r"[\s\S]"},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "pad_token": PAD,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    return {
        TOKENIZER_FILE: json.dumps(spec, ensure_ascii=False, indent=1) + "\n",
        TOKENIZER_CONFIG_FILE: json.dumps(config, indent=1) + "\n",
    }


def save_char_tokenizer(directory: Path, tokenizer: CharTokenizer | None = None) -> Path:
    """Write the files into `directory` (created if needed), each atomically; returns `directory`.

    Idempotent and safe against concurrent writers: each file is replaced whole by identical content."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in char_tokenizer_files(tokenizer or CharTokenizer()).items():
        path = directory / name
        if not path.exists() or path.read_text() != content:
            atomic_write_text(path, content)
    return directory

"""A tiny character-level tokenizer, and the `Tokenizer` protocol the engine uses.

`CharTokenizer` is the tokenizer of the built-in tiny base model and of the
built-in envs. Its vocabulary is part of that model's contract: ids never change
(new characters may only be appended, and the total stays <= 128).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
REPLACEMENT = "\ufffd"
# Order fixes the ids: specials 0-3, then these characters from 4 on.
CHARACTERS: str = "0123456789 +-*/=?:.,!()<>'\nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without special tokens."""
        ...


class CharTokenizer:
    """One token per character; unknown characters map to `<unk>`."""

    def __init__(self) -> None:
        self._itos: tuple[str, ...] = SPECIAL_TOKENS + tuple(CHARACTERS)
        self._stoi: dict[str, int] = {s: i for i, s in enumerate(self._itos)}
        assert len(self._stoi) == len(self._itos), "duplicate characters in the vocabulary"
        assert len(self._itos) <= 128

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def bos_token_id(self) -> int:
        return 1

    @property
    def eos_token_id(self) -> int:
        return 2

    @property
    def unk_token_id(self) -> int:
        return 3

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self._stoi.get(ch, self.unk_token_id) for ch in text]
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`. PAD, BOS and EOS are dropped when `skip_special_tokens`; `<unk>` and ids
        beyond the vocabulary (a model may pad its embedding matrix) become U+FFFD, never nothing:
        "1<unk>2" must not read as the answer "12"."""
        out: list[str] = []
        for i in ids:
            if not 0 <= i < len(self._itos) or i == self.unk_token_id:
                out.append(REPLACEMENT if skip_special_tokens else UNK)
            elif i < len(SPECIAL_TOKENS):
                if not skip_special_tokens:
                    out.append(self._itos[i])
            else:
                out.append(self._itos[i])
        return "".join(out)

    def id_to_token(self, i: int) -> str:
        return self._itos[i]


class HFTokenizer:
    """Adapts a Hugging Face tokenizer to `Tokenizer` (special tokens are skipped on decode)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @property
    def bos_token_id(self) -> int | None:
        # `_tok` is untyped (transformers has no stubs): the annotations say what we rely on.
        bos: int | None = self._tok.bos_token_id
        return bos

    @property
    def eos_token_id(self) -> int:
        eos: int = self._tok.eos_token_id
        return eos

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=True)
        return text


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt ids: BOS (when the tokenizer has one) followed by the text."""
    ids = list(tokenizer.encode(text))
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids

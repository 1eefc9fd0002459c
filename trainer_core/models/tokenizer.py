"""The character tokenizer of the built-in `loraloom-tiny` model, built in code (no download).

Small and stable on purpose: the trainer, the samplers and the demo envs must agree on
every id, and a tiny model learns a small vocabulary quickly.
"""

from dataclasses import dataclass, field

PAD, BOS, EOS = 0, 1, 2
_SPECIALS = ("<pad>", "<s>", "</s>")
_CHARS = "0123456789+-*=?:;,. abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class CharTokenizer:
    chars: str = _CHARS
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {c: i + len(_SPECIALS) for i, c in enumerate(self.chars)})

    pad_token_id: int = PAD
    bos_token_id: int = BOS
    eos_token_id: int = EOS

    @property
    def vocab_size(self) -> int:
        return len(_SPECIALS) + len(self.chars)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        unknown = sorted({c for c in text if c not in self._index})
        if unknown:
            raise ValueError(f"characters outside the tokenizer's alphabet: {unknown}")
        ids = [self._index[c] for c in text]
        return [BOS, *ids] if bos else ids

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            if i < len(_SPECIALS):
                if not skip_special:
                    out.append(_SPECIALS[i])
                continue
            out.append(self.chars[i - len(_SPECIALS)])
        return "".join(out)


TOKENIZER = CharTokenizer()

"""A character-level tokenizer with a fixed vocabulary kept in the repository.

Nothing is downloaded or trained: every character the arithmetic task writes has one id, and
three special ids frame a sequence (PAD fills batches, BOS starts one, EOS ends a response).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")

# Digits, the operators, the layout characters and the letters the working uses ("A" marks the
# final answer). Order fixes the ids; append only, or saved models stop matching.
CHARACTERS = "0123456789+-*= \nA"


class UnknownCharacterError(ValueError):
    """Text contained a character outside the fixed vocabulary."""


@dataclass(frozen=True)
class CharTokenizer:
    """Maps the task's characters to ids and back; ids below `len(SPECIAL_TOKENS)` are special."""

    characters: str = CHARACTERS
    _char_to_id: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(set(self.characters)) != len(self.characters):
            raise ValueError("tokenizer characters must be unique")
        first = len(SPECIAL_TOKENS)
        object.__setattr__(self, "_char_to_id", {ch: first + i for i, ch in enumerate(self.characters)})

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.characters)

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of `text`, one per character, optionally framed by BOS / EOS."""
        ids = [BOS_ID] if add_bos else []
        for ch in text:
            token = self._char_to_id.get(ch)
            if token is None:
                raise UnknownCharacterError(f"character {ch!r} is not in the vocabulary")
            ids.append(token)
        if add_eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Text of `ids`: special ids are dropped, and decoding ends at the first EOS if asked."""
        first = len(SPECIAL_TOKENS)
        chars: list[str] = []
        for token in ids:
            if token == EOS_ID and stop_at_eos:
                break
            if token < first:
                continue
            index = token - first
            if index >= len(self.characters):
                raise ValueError(f"token id {token} is outside the vocabulary of {self.vocab_size}")
            chars.append(self.characters[index])
        return "".join(chars)

    def token_names(self) -> Sequence[str]:
        """Every id's printable name, in id order (for logs and debugging)."""
        return (*SPECIAL_TOKENS, *self.characters)

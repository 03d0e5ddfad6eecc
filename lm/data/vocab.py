"""A word-level vocabulary: an explicit list of tokens, text = tokens joined by spaces."""

from collections.abc import Sequence

import torch


class Vocab:
    """Token strings <-> ids (the index in ``tokens``).

    ``unk``: the token that unknown words map to; None makes an unknown word a ValueError.
    """

    def __init__(self, tokens: Sequence[str], unk: str | None = None):
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        if len(self.ids) != len(self.tokens):
            raise ValueError(f"tokens must be distinct, got {self.tokens}")
        if unk is not None and unk not in self.ids:
            raise ValueError(f"unk {unk!r} is not in the vocabulary")
        self.unk = unk

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, token: str) -> int:
        return self.ids[token]

    def encode_words(self, words: Sequence[str]) -> list[int]:
        if self.unk is None:
            unknown = [w for w in words if w not in self.ids]
            if unknown:
                raise ValueError(f"unknown tokens {unknown[:5]}; the vocabulary is {self.tokens}")
            return [self.ids[w] for w in words]
        unk_id = self.ids[self.unk]
        return [self.ids.get(w, unk_id) for w in words]

    def encode(self, text: str) -> list[int]:
        return self.encode_words(text.split())

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        bad = [i for i in ids if not 0 <= i < len(self.tokens)]
        if bad:
            raise ValueError(f"ids must be in [0, {len(self.tokens)}), got {bad[:5]}")
        return " ".join(self.tokens[i] for i in ids)

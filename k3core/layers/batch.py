"""Where each sequence's new tokens sit in a packed forward (prefill chunks and decode steps alike).

A layout is immutable and every layer of a forward asks it the same questions, so the answers are cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class BatchLayout:
    context_lens: tuple[int, ...]  # tokens cached per sequence before this forward
    new_token_counts: tuple[int, ...]  # new tokens per sequence, packed in this order

    @classmethod
    def of(cls, context_lens: list[int], new_token_counts: list[int]) -> BatchLayout:
        if len(context_lens) != len(new_token_counts):
            raise ValueError(f"{len(context_lens)} context lengths for {len(new_token_counts)} sequences")
        if any(n < 1 for n in new_token_counts):
            raise ValueError(f"every sequence needs at least one new token, got {list(new_token_counts)}")
        return cls(tuple(context_lens), tuple(new_token_counts))

    @property
    def num_sequences(self) -> int:
        return len(self.new_token_counts)

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.new_token_counts)

    @cached_property
    def is_decode(self) -> bool:
        """One new token per sequence: the single-step paths apply."""
        return all(n == 1 for n in self.new_token_counts)

    @cached_property
    def token_ranges(self) -> list[tuple[int, int]]:
        bounds = self.cu_seqlens_list
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    @cached_property
    def cu_seqlens_list(self) -> list[int]:
        out = [0]
        for n in self.new_token_counts:
            out.append(out[-1] + n)
        return out

    def cu_seqlens(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.tensor(self.cu_seqlens_list, dtype=torch.long, device=device)

    def last_token_indices(self) -> list[int]:
        return [end - 1 for _, end in self.token_ranges]

"""The simple BatchCache: each sequence owns plain contiguous tensors (the offline oracle and CPU path).

Writes of a forward are staged and only land on `commit()`, so a forward that fails half way leaves
every sequence exactly as it was (a retry sees the same state).
"""

from __future__ import annotations

import torch

from k3core.config import K3Config


class SequenceCache:
    """All caches of one sequence: KDA conv + recurrent state per KDA layer, MLA latents per MLA layer."""

    def __init__(
        self,
        config: K3Config,
        dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        heads, dim, width = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        kda_layers = len(config.kda_layers)
        self.kda_conv = torch.zeros(kda_layers, 3, heads, dim, width - 1, dtype=dtype, device=device)
        self.kda_state = torch.zeros(kda_layers, heads, dim, dim, dtype=state_dtype, device=device)
        self._mla = [
            torch.zeros(0, config.mla_latent_dim, dtype=dtype, device=device) for _ in config.mla_layers
        ]
        self.length = 0

    def mla_rows(self, mla_layer: int, rows: int) -> torch.Tensor:
        return self._mla[mla_layer][:rows]

    def write_mla(self, mla_layer: int, start: int, latent: torch.Tensor) -> None:
        """Write rows [start, start + n); the buffer grows geometrically so decode appends stay O(1)."""
        end = start + latent.shape[0]
        buffer = self._mla[mla_layer]
        if buffer.shape[0] < end:
            grown = buffer.new_zeros(max(end, 2 * buffer.shape[0]), buffer.shape[1])
            grown[:start] = buffer[:start]
            self._mla[mla_layer] = buffer = grown
        buffer[start:end] = latent.to(buffer.dtype)

    def clone(self) -> SequenceCache:
        """An independent copy (fork a sequence, or keep a snapshot to resume from)."""
        copy = object.__new__(SequenceCache)
        copy.kda_conv, copy.kda_state = self.kda_conv.clone(), self.kda_state.clone()
        copy._mla = [m[: self.length].clone() for m in self._mla]
        copy.length = self.length
        return copy

    def nbytes(self) -> int:
        """Bytes in use: the fixed KDA state plus the MLA rows of `length` tokens."""
        fixed = (
            self.kda_conv.numel() * self.kda_conv.element_size()
            + self.kda_state.numel() * self.kda_state.element_size()
        )
        return fixed + sum(self.length * m.shape[1] * m.element_size() for m in self._mla)


class ContiguousBatchCache:
    """A BatchCache (k3core.cache.interface) over a list of SequenceCaches for one forward."""

    def __init__(self, sequences: list[SequenceCache], new_token_counts: list[int]) -> None:
        if len(sequences) != len(new_token_counts):
            raise ValueError(f"{len(sequences)} sequences but {len(new_token_counts)} new-token counts")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("the same SequenceCache appears twice in one batch")
        self.sequences = sequences
        self._counts = list(new_token_counts)
        self._kda: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mla_written: set[int] = set()

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    @property
    def context_lens(self) -> list[int]:
        return [s.length for s in self.sequences]

    @property
    def new_token_counts(self) -> list[int]:
        return list(self._counts)

    def kda_read(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv = torch.stack([s.kda_conv[kda_layer] for s in self.sequences])
        state = torch.stack([s.kda_state[kda_layer] for s in self.sequences])
        return conv, state

    def kda_write(self, kda_layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        self._kda[kda_layer] = (conv_state, recurrent_state)

    def mla_append(self, mla_layer: int, latent: torch.Tensor) -> None:
        if latent.shape[0] != sum(self._counts):
            raise ValueError(f"mla_append got {latent.shape[0]} rows for {sum(self._counts)} new tokens")
        # Rows past `length` are scratch until commit, so a failed forward leaves nothing behind.
        for seq, rows in zip(self.sequences, latent.split(self._counts), strict=True):
            seq.write_mla(mla_layer, seq.length, rows)
        self._mla_written.add(mla_layer)

    def mla_read(self, mla_layer: int, seq: int) -> torch.Tensor:
        sequence = self.sequences[seq]
        rows = sequence.length + (self._counts[seq] if mla_layer in self._mla_written else 0)
        return sequence.mla_rows(mla_layer, rows)

    def commit(self) -> None:
        """Land the staged KDA states and advance every sequence past its new tokens."""
        for layer, (conv, state) in self._kda.items():
            for b, seq in enumerate(self.sequences):
                seq.kda_conv[layer] = conv[b]
                seq.kda_state[layer] = state[b]
        for seq, count in zip(self.sequences, self._counts, strict=True):
            seq.length += count
        self._kda.clear()
        self._mla_written.clear()

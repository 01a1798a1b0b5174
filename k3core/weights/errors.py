"""Checkpoint errors that say everything wrong at once, so one fix-and-retry suffices."""

from __future__ import annotations

from collections.abc import Sequence


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or written as asked; the message names the file."""


class CheckpointMismatchError(CheckpointError):
    """Tensors missing, unexpected or of the wrong shape, all listed in one message."""

    def __init__(
        self,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
        *,
        where: str = "checkpoint",
    ) -> None:
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        lines = [f"{where} does not match the model:"]
        if self.missing:
            lines.append(f"  missing ({len(self.missing)}): " + ", ".join(self.missing))
        if self.unexpected:
            lines.append(f"  unexpected ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        for name, want, got in self.mismatched:
            lines.append(f"  shape of {name}: model wants {list(want)}, checkpoint has {list(got)}")
        super().__init__("\n".join(lines))

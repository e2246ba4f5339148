"""The error every distributed call raises when the job, not this rank's input, went wrong."""

from __future__ import annotations


class DistributedError(RuntimeError):
    """A collective failed: another rank raised, died, or stopped making the same calls."""

"""A scheduler's limits: one frozen dataclass, checked when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler. long_prefill_token_threshold caps the tokens any one request
    gets per step (None: only the budget caps them), so that long prompts interleave.
    max_prefill_tokens_with_decodes caps the prompt tokens of a step that also carries
    decodes (None: only the budget caps them): a step's length is every running stream's gap
    between two tokens, and the prompt chunks make most of it, while a step with no decode
    in it still takes the whole budget for the first tokens."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = "recompute"
    eos_token_ids: tuple[int, ...] = ()
    long_prefill_token_threshold: int | None = None
    max_prefill_tokens_with_decodes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not isinstance(self.eos_token_ids, tuple) or any(t < 0 for t in self.eos_token_ids):
            raise ValueError(
                f"eos_token_ids must be a tuple of ids >= 0, got {self.eos_token_ids!r}"
            )
        for name in ("long_prefill_token_threshold", "max_prefill_tokens_with_decodes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")

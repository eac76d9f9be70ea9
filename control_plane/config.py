"""The control plane's configuration: one frozen dataclass, built from flags/env in
pagedserve.cli."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from control_plane.chat import check_template
from pagedserve.grpc_security import INSECURE, GrpcSecurity

PREEMPTION_MODES = ("recompute", "swap")
# What one Generate call may ask for (docs/architecture.md, "Per-request budget"): generated
# tokens, n x max_tokens; logprob entries, each token's own and its alternatives'.
DEFAULT_MAX_REQUEST_TOKENS = 1 << 18
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 20


# The prompt tokens of a step that also carries decodes (SchedulerConfig), unless set: the
# control plane's and the simulator's default.
DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES = 1024


@dataclass(frozen=True)
class ControlPlaneConfig:
    workers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int | None = None
    # None: no cap.
    max_prefill_tokens_with_decodes: int | None = DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES
    preemption: Literal["recompute", "swap"] = "recompute"
    max_waiting: int | None = None  # None: max_num_seqs per healthy worker
    # A request expected to wait longer than this for its first token because of the others
    # is refused at once (control_plane.admission); None: no such bound.
    max_queue_delay_s: float | None = None
    tokenizer: str | None = None  # defaults to the model path the worker reports
    # The chat template's text (--chat-template, loaded); None: the checkpoint's, or the one
    # control_plane.chat_templates ships for it.
    chat_template: str | None = None
    served_model_name: str | None = None
    worker_connect_timeout_s: float = 300.0  # for the first worker at startup; 0: no limit
    # A request that comes before any worker has registered waits this long for one; 0: it is
    # refused at once.
    worker_wait_timeout_s: float = 30.0
    enable_prefix_caching: bool = True
    async_scheduling: bool = True  # plan step n+1 while the worker runs step n
    worker_failover_s: float = 10.0  # a worker silent this long loses its requests to others
    grpc_security: GrpcSecurity = INSECURE  # for the port it serves and its worker channels
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS  # n x max_tokens of one Generate
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES  # logprob entries one Generate returns
    grammar_compile_timeout_s: float = 10.0  # a constraint compiling longer is refused
    step_trace: str | None = None  # a file to append one JSON line per worker step to

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("at least one worker address (HOST:PORT) is required")
        for w in self.workers:
            host, sep, port = w.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address must be HOST:PORT, got {w!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and cap < 1:
            raise ValueError("max_prefill_tokens_with_decodes must be >= 1")
        if self.max_waiting is not None and self.max_waiting < 1:
            # 0 would refuse every request: admission comes before a request can run.
            raise ValueError("max_waiting must be >= 1 (or auto)")
        if self.max_queue_delay_s is not None and not self.max_queue_delay_s > 0:
            raise ValueError("max_queue_delay_s must be > 0 (or None)")
        if self.max_request_tokens < 1 or self.max_logprob_entries < 1:
            raise ValueError("max_request_tokens and max_logprob_entries must be >= 1")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout_s must be > 0")
        if self.worker_connect_timeout_s < 0:
            raise ValueError("worker_connect_timeout_s must be >= 0 (0: no limit)")
        if self.worker_wait_timeout_s < 0:
            raise ValueError("worker_wait_timeout_s must be >= 0 (0: no wait)")
        if self.chat_template is not None:
            check_template(self.chat_template)
        if not (0 < self.port < 65536):
            raise ValueError(f"port must be in 1..65535, got {self.port}")

"""How long a worker takes for one step, from the plan's batch.

A step's cost is a roofline per kind of kernel, the projections' GEMMs and attention, which
run one after the other, plus fixed costs:

    gemms     = max((2 · params · tokens + 2 · hidden · vocab · sampled rows)
                    / (peak FLOP/s · flops_efficiency),
                    weights / (bandwidth · bandwidth_efficiency))
    attention = max(4 · layers · q_dim · attention pairs / (peak FLOP/s · attention_efficiency),
                    (KV read: each row's context + KV written: new tokens)
                    / (bandwidth · bandwidth_efficiency))
    step      = overhead + per_row · rows + per_token · tokens + gemms + attention
                + all-reduce (tensor parallel) + swap (blocks over the host link)

"attention pairs" are the query-key pairs a row's new tokens attend to (causal within the
new tokens); their arithmetic runs at its own efficiency (attention kernels reach less of the
peak than the projections' GEMMs). Decode is bound by the weights and the KV it streams,
prefill by arithmetic.
Tensor parallelism divides compute, weights and KV by the TP size and adds
2 · layers + 1 ring all-reduces of the step's activations per step, each costing a latency
plus 2 (tp - 1) / tp of the message over the interconnect.

A `DeviceProfile` holds the peaks and the fitted constants. GPU profiles start from the
spec sheet (`hardware.GPUS`) with achievable fractions as parameters; the `cpu` profile is
fitted from our worker's measured step times (`simulator.calibrate`) and stored as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pagedserve.plan import StepShape
from simulator.hardware import GIB, Gpu, ModelShape, resolve_gpu

PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float
    bandwidth: float
    memory_bytes: int
    link_bandwidth: float
    host_bandwidth: float
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    attention_efficiency: float = 0.4
    overhead_s: float = 0.0015  # per step: launch, batch building, sampling
    per_row_s: float = 2e-6
    per_token_s: float = 0.0
    allreduce_latency_s: float = 10e-6
    fitted: dict[str, Any] = field(default_factory=dict)  # where a fitted profile came from

    @classmethod
    def for_gpu(cls, gpu: Gpu | str, **overrides: float) -> DeviceProfile:
        g = resolve_gpu(gpu) if isinstance(gpu, str) else gpu
        base = cls(
            g.name,
            g.bf16_flops,
            g.hbm_bandwidth,
            g.memory_bytes,
            g.link_bandwidth,
            g.host_bandwidth,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path) -> DeviceProfile:
        return cls(**json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


def resolve_profile(name: str, **overrides: float) -> DeviceProfile:
    """A GPU from the table, `cpu` (the fitted profile shipped in simulator/profiles/), or a
    path to a profile JSON."""
    path = Path(name)
    if name == "cpu" or name.startswith("cpu-"):
        path = PROFILES_DIR / f"{name}.json"
    if path.suffix == ".json":
        if not path.exists():
            raise ValueError(
                f"no device profile at {path}: fit one with `python -m simulator.calibrate`"
            )
        return replace(DeviceProfile.load(path), **overrides)  # type: ignore[arg-type]
    return DeviceProfile.for_gpu(name, **overrides)


class CostModel:
    def __init__(
        self, profile: DeviceProfile, model: ModelShape, tp: int = 1, block_size: int = 16
    ) -> None:
        if tp < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
        self.profile = profile
        self.model = model
        self.tp = tp
        self.block_size = block_size
        m = model
        self._flops_per_token = 2 * m.num_layers * m.layer_params / tp
        self._lm_head_flops = 2 * m.hidden_size * m.vocab_size / tp
        self._attn_flops_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim / tp
        self._weight_bytes = m.weight_bytes / tp
        self._kv_bytes = m.kv_bytes_per_token / tp
        self._flops_rate = profile.peak_flops * profile.flops_efficiency
        self._bytes_rate = profile.bandwidth * profile.bandwidth_efficiency
        self._attn_rate = profile.peak_flops * profile.attention_efficiency
        self._allreduces = 2 * m.num_layers + 1 if tp > 1 else 0
        self._allreduce_bytes_per_token = (
            2 * (tp - 1) / tp * m.hidden_size * m.dtype_bytes if tp > 1 else 0.0
        )
        self._block_bytes = block_size * self._kv_bytes

    def step_time(self, s: StepShape) -> float:
        p = self.profile
        if not s.tokens:  # no forward pass: only the plan's block moves (tenths of a ms else)
            return s.swapped_blocks * self._block_bytes / p.host_bandwidth
        flops = self._flops_per_token * s.tokens + self._lm_head_flops * s.sampled_rows
        kv_bytes = self._kv_bytes * (s.context_tokens + s.tokens)
        t = p.overhead_s + p.per_row_s * s.rows + p.per_token_s * s.tokens
        t += max(flops / self._flops_rate, self._weight_bytes / self._bytes_rate)
        t += max(
            self._attn_flops_per_pair * s.attention_pairs / self._attn_rate,
            kv_bytes / self._bytes_rate,
        )
        if self._allreduces:
            t += self._allreduces * (
                p.allreduce_latency_s
                + s.tokens * self._allreduce_bytes_per_token / p.link_bandwidth
            )
        if s.swapped_blocks:
            t += s.swapped_blocks * self._block_bytes / p.host_bandwidth
        return t

    # -- memory -------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> float:
        """One KV block on one rank."""
        return self._block_bytes

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """The peak a profiling pass of one full-budget prefill measures: the widest
        activations of the batch's tokens plus float32 logits of every sequence."""
        m = self.model
        per_token = (4 * m.hidden_size + 2 * m.intermediate_size / self.tp) * m.dtype_bytes
        return max_num_batched_tokens * per_token + max_num_seqs * m.vocab_size * 4

    def num_gpu_blocks(
        self,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
    ) -> int:
        """KV blocks per rank, as the worker sizes its pool under --gpu-memory-utilization:
        the budget, less the rank's weights and the profiled activation peak."""
        budget = self.profile.memory_bytes * gpu_memory_utilization
        left = (
            budget
            - self._weight_bytes
            - self.activation_bytes(max_num_batched_tokens, max_num_seqs)
        )
        if left <= 0:
            raise ValueError(
                f"{self.model.name} at TP {self.tp} does not fit on {self.profile.name}: "
                f"{self._weight_bytes / GIB:.1f} GiB of weights per rank, "
                f"{budget / GIB:.1f} GiB budget"
            )
        return math.floor(left / self._block_bytes)

    def num_cpu_blocks(self, swap_space_bytes: float) -> int:
        return math.floor(swap_space_bytes / self._block_bytes)


class ReplayedCost(CostModel):
    """A real run's step times in step order, in place of the roofline: a one-worker
    simulation of that run with them differs from it only where the scheduler saw different
    arrivals between steps. Steps past the replayed ones fall back to the roofline."""

    def __init__(self, base: CostModel, seconds: Sequence[float]) -> None:
        super().__init__(base.profile, base.model, base.tp, base.block_size)
        self._seconds = list(seconds)
        self._next = 0

    def step_time(self, s: StepShape) -> float:
        i = self._next
        self._next += 1
        return self._seconds[i] if i < len(self._seconds) else super().step_time(s)

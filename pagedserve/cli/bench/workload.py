"""Benchmark requests: random token-id prompts, or prompts that share prefixes.

Lengths are given as `N` (fixed) or `LO:HI` (uniform, inclusive). Token ids avoid the first
three ids (pad, BOS, EOS in pagedserve's checkpoints) so no prompt carries a stray special
token. Everything comes from one seed: the same arguments give the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ORDINARY_ID = 3


@dataclass(frozen=True)
class LengthRange:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"lengths must satisfy 1 <= lo <= hi, got {self.lo}:{self.hi}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """'128' -> 128..128; '32:256' -> 32..256."""
        lo, _, hi = text.partition(":")
        try:
            return cls(int(lo), int(hi or lo))
        except ValueError as exc:
            raise ValueError(f"bad length {text!r}: use N or LO:HI ({exc})") from None

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        """As it is typed (`--help` shows a default so): `N` or `LO:HI`."""
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class BenchRequest:
    """A completion of token ids `prompt`, or (when `chat` is set) a chat turn whose user
    message is `chat` (then `prompt` is empty)."""

    prompt: list[int]
    max_tokens: int
    chat: str | None = None


def chat_requests(num: int, max_tokens: int, round_: int = 0) -> list[BenchRequest]:
    """The first `num` chat prompts (cycled), each opened with round `round_`'s lead-in."""
    from pagedserve.cli.bench.chat_prompts import CHAT_PROMPTS, LEAD_INS

    lead = LEAD_INS[round_ % len(LEAD_INS)]
    return [
        BenchRequest([], max_tokens, chat=lead + CHAT_PROMPTS[i % len(CHAT_PROMPTS)])
        for i in range(num)
    ]


def random_requests(
    num: int, prompt_len: LengthRange, output_len: LengthRange, vocab_size: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = prompt_len.draw(rng)
        prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)]
        out.append(BenchRequest(prompt, output_len.draw(rng)))
    return out


def shared_prefix_requests(
    num: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: LengthRange,
    output_len: LengthRange,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """`num_prefixes` system-prompt-like prefixes of `prefix_len` tokens, each request one of
    them (round robin) followed by its own random suffix: the prefix cache's workload."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("num_prefixes and prefix_len must be >= 1")
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(prefix_len)]
        for _ in range(num_prefixes)
    ]
    out = []
    for i in range(num):
        suffix = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(suffix_len.draw(rng))]
        out.append(BenchRequest(prefixes[i % num_prefixes] + suffix, output_len.draw(rng)))
    return out

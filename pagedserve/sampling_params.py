"""Sampling parameters shared by the control plane (admission, stop checks) and the worker
(the sampler). Validation lives here so that every entry point rejects the same inputs: the
numeric parameters' ranges are one table, `RANGES`, which `SamplingParams` checks and the
gateway's request bodies declare (their OpenAPI bounds included)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Literal

# float32's smallest normal number (2^-126): the least positive value a float field of the
# protos keeps as such.
FLOAT32_TINY = 1.1754943508222875e-38
# A little under -ln(FLOAT32_TINY) = 87.34, itself under ln(float32 max) = 88.72: where |x|
# stays under it, exp(x) is a finite, normal float32.
FLOAT32_LOG_MAX = 87.3
# Default max_tokens when a client leaves it unset, as OpenAI's completions API does.
DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_N = 16  # parallel samples per request
MAX_BEAM_WIDTH = 16
EarlyStopping = bool | str  # True, False or "never", as transformers' early_stopping
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# The largest values the protos' uint32 and int32 fields carry.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """The values a numeric parameter takes: from low to high, each end included unless it is
    open. A NaN is in no range."""

    low: int | float
    high: int | float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: int | float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return (
            f"{'(' if self.low_open else '['}{_shown(self.low)}, "
            f"{_shown(self.high)}{')' if self.high_open else ']'}"
        )


def _shown(x: int | float) -> str:
    """A bound as messages write it: 10000 for 1e4, 2**63 for 9223372036854775808."""
    if isinstance(x, int) and x >= 1 << 32 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


# Every numeric sampling parameter's range. max_tokens, min_tokens and top_k go up to what
# their proto fields carry (min_tokens also at most max_tokens; top_k 0 is off, and the
# gateway takes vLLM's -1 for it too). logit_bias is each token's bias.
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, UINT32_MAX),
    "temperature": Range(0.0, 1e4),
    "top_k": Range(0, INT32_MAX),
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, 100.0, low_open=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "seed": Range(0, 2**63, high_open=True),
    "logprobs": Range(0, MAX_LOGPROBS),
    "prompt_logprobs": Range(0, MAX_LOGPROBS),
    "min_tokens": Range(0, UINT32_MAX),
    "n": Range(1, MAX_N),
    "beam_width": Range(1, MAX_BEAM_WIDTH),
    "length_penalty": Range(-1e3, 1e3),
    "logit_bias": Range(-100, 100),
}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text: `kind` and its `spec` (a JSON schema as JSON text,
    "" for any JSON object, a regex, a JSON list of choice strings, or an EBNF grammar).
    Hashable, so it keys the compiled-grammar caches."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidRequestError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError("json_schema must be a JSON object")
        elif self.kind == "choice":
            choices = json.loads(self.spec) if self.spec else []
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        elif self.kind in ("regex", "grammar") and not self.spec:
            raise InvalidRequestError(f"{self.kind} must not be empty")

    @classmethod
    def choices(cls, options: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(options, ensure_ascii=False))

    @property
    def choice_list(self) -> list[str]:
        return list(json.loads(self.spec))


class InvalidRequestError(ValueError):
    """A request that can never be served as asked. Maps to gRPC INVALID_ARGUMENT / HTTP 400."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters. A seed makes the request's draws reproducible whatever else is in the batch.
    logprobs is None (none returned) or the number of top alternatives to return beside the
    chosen token's log-probability (0 means just the chosen token). n > 1 asks for n
    completions of one prompt (parallel sampling): the control plane forks the request into n
    children with n == 1 and their own seeds, so a worker only ever sees n == 1.
    include_stop_str_in_output keeps a matched stop string at the end of the text.
    prompt_logprobs is None or, as logprobs, the alternatives to return beside each prompt
    token's log-probability given the tokens before it (the first prompt token has none); a
    request asking for them computes its whole prompt (no prefix-cache hits).

    beam_width > 0 asks for beam search, exactly as transformers' generate(num_beams=
    beam_width, num_return_sequences=n, do_sample=False, length_penalty=length_penalty,
    early_stopping=early_stopping): deterministic, so it takes no sampling filters, penalties,
    logprobs or stop conditions other than EOS and max_tokens (temperature may be 0 or 1, and
    is ignored; a seed is ignored).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    structured: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        for name in _CHECKED_FIRST:
            _check_range(name, getattr(self, name))
        if any(not s for s in self.stop):
            raise bad("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative")
        if self.min_tokens not in RANGES["min_tokens"] or self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        _check_range("n", self.n)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(
                f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            raise bad("logit_bias names a token id twice")
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # The constraint ends the output where it is complete (EOS is then the only token
            # it allows): nothing may follow, and it may be shorter than min_tokens.
            raise bad(
                "structured output ends where the constraint is complete: it takes no "
                + ("ignore_eos" if self.ignore_eos else "min_tokens")
            )
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise bad(f"logit_bias: token id {token_id} is negative")
            if bias not in RANGES["logit_bias"]:
                raise bad(
                    f"logit_bias: the bias of token {token_id} must be in {RANGES['logit_bias']}, "
                    f"got {bias}"
                )
        if self.beam_width:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        _check_range("beam_width", self.beam_width)
        if self.n > self.beam_width:
            raise InvalidRequestError(
                f"beam search returns at most beam_width ({self.beam_width}) sequences, "
                f"n is {self.n}"
            )
        _check_range("length_penalty", self.length_penalty)
        if why := length_penalty_out_of_range(self.length_penalty, self.max_tokens):
            raise InvalidRequestError(why)
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )
        defaults = SamplingParams()
        unsupported = [
            name
            for name in (
                "top_k",
                "top_p",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "logprobs",
                "prompt_logprobs",
                "stop",
                "stop_token_ids",
                "min_tokens",
            )
            if getattr(self, name) != getattr(defaults, name)
        ]
        if self.temperature not in (0.0, 1.0):
            unsupported.insert(0, "temperature")
        if unsupported:
            raise InvalidRequestError(
                f"beam search is deterministic: it takes no {unsupported[0]} "
                f"(got {getattr(self, unsupported[0])!r})"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# Checked in this order before the rest (stop strings, min_tokens against max_tokens, ...).
_CHECKED_FIRST = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
)


def _check_range(name: str, value: int | float | None) -> None:
    """InvalidRequestError unless `value` is None or in the parameter's range."""
    if value is not None and value not in RANGES[name]:
        raise InvalidRequestError(f"{name} must be in {RANGES[name]}, got {value}")


def length_penalty_out_of_range(length_penalty: float, max_tokens: int) -> str | None:
    """Why beam scores of up to max_tokens tokens cannot divide by length ** length_penalty
    in float32 (past its range, or below its normal numbers); None where they can."""
    if abs(length_penalty) * math.log(max(max_tokens, 1)) <= FLOAT32_LOG_MAX:
        return None
    limit = FLOAT32_LOG_MAX / math.log(max_tokens)
    return (
        f"length_penalty {length_penalty}: max_tokens ** length_penalty is past float32's "
        f"range; with max_tokens {max_tokens} it must be within ±{limit:.4g}"
    )


def beam_candidates(beam_width: int, num_eos_token_ids: int) -> int:
    """Candidates a beam-search step keeps, over all beams: as transformers, enough that at
    least beam_width of them do not end in EOS, max(2, 1 + number of EOS ids) x beam_width.
    Each beam row returns this many (the best overall are among the rows' own best)."""
    return max(2, 1 + num_eos_token_ids) * beam_width

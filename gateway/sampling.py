"""The sampling fields /v1/completions and /v1/chat/completions share, their rules, and the
SamplingParams protobuf they become (unset fields stay unset, so the control plane's defaults
apply)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, PrivateAttr

from gateway.errors import bad_request
from gateway.protocol import INTEGRAL, Body, ModelName, RequestBody, TokenId, bounded
from gateway.structured_output import (
    ChoiceList,
    Constraint,
    NonEmptyStr,
    ResponseFormat,
    SchemaOrText,
    StructuredOutputs,
    constraint_proto,
    requested_constraints,
)
from pagedserve.sampling_params import (
    MAX_LOGIT_BIAS,
    RANGES,
    UINT32_MAX,
    EarlyStopping,
    length_penalty_out_of_range,
)
from pagedserve.wire import early_stopping_to_proto
from protos.v1 import common_pb2

StopString = Annotated[str, Field(min_length=1, max_length=1024)]


def _early_stopping(value: Any) -> EarlyStopping:
    if value is True or value is False or value == "never":
        return value  # type: ignore[no-any-return]
    raise ValueError('must be true, false or "never"')


_BIAS = RANGES["logit_bias"]


def _logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as JSON object keys) to biases in their range."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"holds at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and int(key) <= UINT32_MAX):
            raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or bias not in _BIAS:
            raise ValueError(f"the bias of token {key} must be a number in {_BIAS}")
        out[int(key)] = float(bias)
    return out


LogitBias = Annotated[
    dict[int, float] | None,
    PlainValidator(
        _logit_bias,
        json_schema_input_type=dict[
            Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, bounded("logit_bias")]
        ]
        | None,
    ),
    Field(
        description=f"Token id -> bias added to its logit before sampling, in {_BIAS} "
        f"(-100 bans the token, 100 all but forces it); at most {MAX_LOGIT_BIAS} tokens"
    ),
]


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(RequestBody):
    """What /v1/completions and /v1/chat/completions share."""

    _constraint: tuple[Constraint | None] | None = PrivateAttr(default=None)

    model: ModelName | None = None
    max_tokens: Annotated[int, bounded("max_tokens"), INTEGRAL] | None = None
    temperature: Annotated[float, bounded("temperature")] | None = None
    # Positive, and still so in the control plane's float32 (its smallest normal number).
    top_p: Annotated[float, bounded("top_p")] | None = None
    # -1 (vLLM's) or 0: off; -1 is sent as 0.
    top_k: Annotated[int, Field(ge=-1, le=RANGES["top_k"].high), INTEGRAL] | None = None
    min_p: Annotated[float, bounded("min_p")] | None = None
    repetition_penalty: Annotated[float, bounded("repetition_penalty")] | None = None
    presence_penalty: Annotated[float, bounded("presence_penalty")] | None = None
    frequency_penalty: Annotated[float, bounded("frequency_penalty")] | None = None
    n: Annotated[int, bounded("n"), INTEGRAL] = 1
    seed: Annotated[int, bounded("seed"), INTEGRAL] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=64)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: Annotated[int, bounded("min_tokens"), INTEGRAL] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=512)] | None = None
    logit_bias: LogitBias = None
    response_format: ResponseFormat | None = None
    guided_json: SchemaOrText | None = Field(
        None, description="vLLM's: the output is an instance of this JSON schema"
    )
    guided_regex: NonEmptyStr | None = Field(
        None, description="vLLM's: the whole output matches this regular expression"
    )
    guided_choice: ChoiceList | None = Field(
        None, description="vLLM's: the output is one of these strings"
    )
    guided_grammar: NonEmptyStr | None = Field(
        None, description="vLLM's: the output is a sentence of this EBNF grammar (`root ::= ...`)"
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's newer form of the guided_* parameters"
    )
    best_of: Annotated[int, bounded("n"), INTEGRAL] | None = None
    # vLLM's: each prompt token's logprob and this many alternatives (not streamed).
    prompt_logprobs: Annotated[int, bounded("prompt_logprobs"), INTEGRAL] | None = None
    use_beam_search: Annotated[
        bool,
        Field(
            description="Beam search (vLLM's parameter): `best_of` beams (or `n` without it), "
            "the `n` best sequences returned as the choices, best first. Deterministic: takes "
            "no sampling parameters, penalties, logprobs, stop conditions but EOS and "
            "`max_tokens`, nor `stream`"
        ),
    ] = False
    length_penalty: Annotated[
        float,
        bounded(
            "length_penalty",
            description="With `use_beam_search`: a sequence's score is its logprob sum / "
            "length^length_penalty; ignored without it",
        ),
    ] = 1.0
    early_stopping: Annotated[
        bool | Literal["never"],
        PlainValidator(_early_stopping, json_schema_input_type=bool | Literal["never"]),
        Field(
            description="With `use_beam_search`, when the search ends, as transformers' "
            "`early_stopping`: true, as soon as `best_of` sequences have finished; false, once "
            'no running beam is likely to beat them; "never", once none can; ignored '
            "without it"
        ),
    ] = False

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        max_tokens = self.effective_max_tokens()
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise bad_request("min_tokens must not exceed max_tokens", "min_tokens")
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        self.output_constraint()
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request(
                "prompt_logprobs is not available when stream is true", "prompt_logprobs"
            )
        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                "best_of other than n is not supported (but with use_beam_search)", "best_of"
            )

    def constraints(self) -> list[Constraint]:
        """Every output constraint the request asks for, in the order the fields are listed."""
        return requested_constraints(self)

    def output_constraint(self) -> Constraint | None:
        """The request's one output constraint; a 400 naming both when it asks for two."""
        if self._constraint is None:
            found = self.constraints()
            if len(found) > 1:
                raise bad_request(
                    f"at most one output constraint per request: {found[0].param} and "
                    f"{found[1].param} were both given",
                    found[1].param,
                )
            self._constraint = (found[0] if found else None,)
        return self._constraint[0]

    @property
    def beam_width(self) -> int:
        """Beams to search: best_of, else n; 0 without use_beam_search."""
        if not self.use_beam_search:
            return 0
        return self.best_of if self.best_of is not None else self.n

    def beam_search_conflicts(self) -> list[tuple[str, Any]]:
        """(field, value) of each field set to what beam search cannot take, in the order a
        400 names them: it is deterministic, and stops only at EOS and max_tokens."""
        out: list[tuple[str, Any]] = []
        if self.temperature not in (None, 0.0, 1.0):
            out.append(("temperature", self.temperature))
        unset_or_default: dict[str, tuple[Any, ...]] = {
            "top_k": (None, -1, 0),
            "top_p": (None, 1.0),
            "min_p": (None, 0.0),
            "repetition_penalty": (None, 1.0),
            "presence_penalty": (None, 0.0),
            "frequency_penalty": (None, 0.0),
            "prompt_logprobs": (None,),
            "stop": (None, []),
            "stop_token_ids": (None, []),
            "min_tokens": (0,),
        }
        for name, allowed in unset_or_default.items():
            value = getattr(self, name)
            if value not in allowed:
                out.append((name, value))
        return out

    def _check_beam_search(self) -> None:
        if self.stream:
            raise bad_request(
                "use_beam_search cannot stream: the sequences are known only when the search "
                "ends; send stream false",
                "stream",
            )
        if self.best_of is not None and self.best_of < self.n:
            raise bad_request(
                f"with use_beam_search, best_of (the beam width, {self.best_of}) must be at "
                f"least n (the sequences returned, {self.n})",
                "best_of",
            )
        max_tokens = self.effective_max_tokens()
        if max_tokens and (why := length_penalty_out_of_range(self.length_penalty, max_tokens)):
            raise bad_request(why, "length_penalty")
        conflicts = self.beam_search_conflicts()
        if conflicts:
            name, value = conflicts[0]
            raise bad_request(
                f"beam search is deterministic: it takes no {name} (got {value!r}); leave it "
                "out with use_beam_search",
                name,
            )


def sampling_proto(body: SamplingFields, logprobs: int | None) -> common_pb2.SamplingParams:
    """The body's sampling fields; unset ones stay unset so the control plane's defaults apply."""
    msg = common_pb2.SamplingParams(
        stop=body.stop_list,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
    )
    if not body.skip_special_tokens:
        msg.skip_special_tokens = False
    msg.include_stop_str_in_output = body.include_stop_str_in_output
    max_tokens = body.effective_max_tokens()
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
    ):
        value = getattr(body, name)
        if value is not None:
            setattr(msg, name, value)
    if body.top_k is not None:
        msg.top_k = max(body.top_k, 0)  # -1 (off, as vLLM spells it) -> 0
    if logprobs is not None:
        msg.logprobs = logprobs
    if body.prompt_logprobs is not None:
        msg.prompt_logprobs = body.prompt_logprobs
    constraint = body.output_constraint()
    if constraint is not None:
        msg.structured_output.CopyFrom(constraint_proto(constraint))
    if body.logit_bias:
        msg.logit_bias.extend(
            common_pb2.LogitBias(token_id=t, bias=b) for t, b in sorted(body.logit_bias.items())
        )
    return msg


def beam_search_proto(body: SamplingFields, sampling: common_pb2.SamplingParams) -> None:
    """use_beam_search as the control plane takes it: the beam width beside n (the sequences
    returned), the length penalty and when to stop. Without it, those two are ignored."""
    if not body.use_beam_search:
        return
    sampling.beam_width = body.beam_width
    if body.length_penalty != 1.0:
        sampling.length_penalty = body.length_penalty
    sampling.early_stopping = early_stopping_to_proto(body.early_stopping)

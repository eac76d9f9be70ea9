"""OpenAI request bodies, validated before anything reaches the control plane.

Types are strict (no "5" for 5) and the ranges are those of
`pagedserve.sampling_params.SamplingParams`, so what passes here is rejected upstream only for
what needs the model: prompt length, vocabulary, context. `check()` covers the rules that
span fields or name features the gateway does not offer.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PlainValidator,
    PrivateAttr,
    model_validator,
)

from gateway.errors import bad_request
from gateway.tools import EMPTY_PARAMETERS, TOOL_NAME, SchemaError, check_schema, required_schema
from pagedserve.json_values import check_json_value
from pagedserve.sampling_params import (
    FLOAT32_TINY,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    EarlyStopping,
    length_penalty_out_of_range,
)

UINT32_MAX = 2**32 - 1
MAX_CHOICES = 256  # prompts x n in one request
# Token ids in one prompt (or one /detokenize): more than any served context holds, so a longer
# list is refused by its length before its ids are looked at.
MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_MESSAGES = 65536  # in one chat


def _integral(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer; so do we (5.5 still fails)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Constraints go before the validator: that way they also reach the JSON schema.
INTEGRAL = BeforeValidator(_integral)
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX), INTEGRAL]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
StopString = Annotated[str, Field(min_length=1, max_length=1024)]


def _early_stopping(value: Any) -> EarlyStopping:
    if value is True or value is False or value == "never":
        return value  # type: ignore[no-any-return]
    raise ValueError('must be true, false or "never"')


def _logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as JSON object keys) to biases in [-100, 100]."""
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
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not (math.isfinite(bias) and -100 <= bias <= 100)
        ):
            raise ValueError(f"the bias of token {key} must be a number in [-100, 100]")
        out[int(key)] = float(bias)
    return out


LogitBias = Annotated[
    dict[int, float] | None,
    PlainValidator(
        _logit_bias,
        json_schema_input_type=dict[
            Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]
        ]
        | None,
    ),
    Field(
        description="Token id -> bias added to its logit before sampling, in [-100, 100] "
        f"(-100 bans the token, 100 all but forces it); at most {MAX_LOGIT_BIAS} tokens"
    ),
]


@dataclass(frozen=True)
class Constraint:
    """What the output must match, and the request field that asked for it. `kind` and
    `spec` as `pagedserve.sampling_params.StructuredOutput` takes them."""

    param: str
    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: str = ""
    choices: tuple[str, ...] = ()


def _schema_text(schema: Any, param: str) -> str:
    """A client's JSON schema (an object, or a string holding one), checked, as compact JSON."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
            check_json_value(schema)
        except RecursionError:
            raise bad_request(f"{param}: JSON nested too deeply", param) from None
        except ValueError as exc:
            raise bad_request(f"{param}: not valid JSON: {exc}", param) from None
    try:
        check_schema(schema, param)
    except SchemaError as exc:
        raise bad_request(f"{exc.path}: {exc.message}", param) from None
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


@functools.cache
def _known_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The names a request body of `cls` may carry (aliases where set)."""
    return frozenset(f.alias or name for name, f in cls.model_fields.items())


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does; the routes log their names.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, _Body):
            known = _known_fields(cls)
            model._ignored = [k for k in data if k not in known]
        return model

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Dotted paths of the request's fields that were dropped as unknown."""
        out = [prefix + k for k in self._ignored]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, _Body):
                out += value.ignored_fields(f"{prefix}{name}.")
            elif value and isinstance(value, list) and isinstance(value[0], _Body):
                # A list holds models or none (never a million token ids walked here).
                for i, item in enumerate(value):
                    out += item.ignored_fields(f"{prefix}{name}.{i}.")
        return out


class _Request(_Body):
    """A whole request body. Before any field is validated, its long lists are counted
    (`check_counts`) and then its strings and nesting checked, once for the whole body: what
    follows walks every item, so a list past its bound costs no more than its parsing."""

    # field -> (most items, what they are): a longer list is a 400 naming the field.
    MAX_COUNTS: ClassVar[dict[str, tuple[int, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _bounds(cls, data: Any) -> Any:
        if isinstance(data, dict):
            cls.check_counts(data)
        check_json_value(data)
        return data

    @classmethod
    def check_counts(cls, data: dict[str, Any]) -> None:
        for name, (limit, items) in cls.MAX_COUNTS.items():
            _check_count(name, data.get(name), limit, items)


def _check_count(param: str, value: Any, limit: int, items: str) -> None:
    """400 for a list `value` longer than `limit`, looking at none of its items."""
    if isinstance(value, list) and len(value) > limit:
        raise bad_request(f"{param}: {len(value)} {items}, more than the limit of {limit}", param)


class StreamOptions(_Body):
    include_usage: bool = False


NonEmptyStr = Annotated[str, Field(min_length=1)]
ChoiceList = Annotated[list[NonEmptyStr], Field(min_length=1)]
SchemaOrText = dict[str, Any] | str


class JsonSchemaFormat(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema the output is an instance of"
    )
    strict: bool | None = Field(
        None, description="Accepted; the output always follows the schema (compact JSON)"
    )


class ResponseFormat(_Body):
    """OpenAI's: plain `text`, any JSON object, or an instance of a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: SchemaOrText | None = Field(
        None, alias="json", description="A JSON schema (or a string holding one)"
    )
    regex: NonEmptyStr | None = None
    choice: ChoiceList | None = None
    grammar: NonEmptyStr | None = Field(None, description="An EBNF grammar (`root ::= ...`)")
    json_object: bool | None = None


class SamplingFields(_Request):
    """What /v1/completions and /v1/chat/completions share."""

    _constraint: tuple[Constraint | None] | None = PrivateAttr(default=None)

    model: Annotated[str, Field(max_length=512)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX), INTEGRAL] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1e4)] | None = None
    # Positive, and still so in the control plane's float32 (its smallest normal number).
    top_p: Annotated[float, Field(ge=FLOAT32_TINY, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1), INTEGRAL] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=FLOAT32_TINY, le=100.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] = 1
    seed: Annotated[int, Field(ge=0, le=2**63 - 1), INTEGRAL] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=64)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX), INTEGRAL] = 0
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
    best_of: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] | None = None
    # vLLM's: each prompt token's logprob and this many alternatives (not streamed).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
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
        Field(
            ge=-1e3,
            le=1e3,
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
        out: list[Constraint] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            out.append(Constraint("response_format", "json_object"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad_request(
                    'response_format of type "json_schema" needs json_schema',
                    "response_format.json_schema",
                )
            param = "response_format.json_schema.schema"
            if rf.json_schema.schema_ is None:
                raise bad_request(f"{param} is required", param)
            spec = _schema_text(rf.json_schema.schema_, param)
            out.append(Constraint(param, "json_schema", spec))
        if self.guided_json is not None:
            spec = _schema_text(self.guided_json, "guided_json")
            out.append(Constraint("guided_json", "json_schema", spec))
        if self.guided_regex is not None:
            out.append(Constraint("guided_regex", "regex", self.guided_regex))
        if self.guided_choice is not None:
            out.append(Constraint("guided_choice", "choice", choices=tuple(self.guided_choice)))
        if self.guided_grammar is not None:
            out.append(Constraint("guided_grammar", "grammar", self.guided_grammar))
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                param = "structured_outputs.json"
                out.append(Constraint(param, "json_schema", _schema_text(so.json_, param)))
            if so.regex is not None:
                out.append(Constraint("structured_outputs.regex", "regex", so.regex))
            if so.choice is not None:
                c = Constraint("structured_outputs.choice", "choice", choices=tuple(so.choice))
                out.append(c)
            if so.grammar is not None:
                out.append(Constraint("structured_outputs.grammar", "grammar", so.grammar))
            if so.json_object:
                out.append(Constraint("structured_outputs.json_object", "json_object"))
        return out

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


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[
            list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)
        ]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    MAX_COUNTS = {"prompt": (MAX_PROMPT_TOKEN_IDS, "token ids")}

    @classmethod
    def check_counts(cls, data: dict[str, Any]) -> None:
        super().check_counts(data)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            for ids in prompt:  # a batch: each prompt on its own
                _check_count("prompt", ids, MAX_PROMPT_TOKEN_IDS, "token ids in one prompt")

    def prompts(self) -> list[str] | list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]

    def beam_search_conflicts(self) -> list[tuple[str, Any]]:
        out = super().beam_search_conflicts()
        if self.logprobs is not None:
            out.append(("logprobs", self.logprobs))
        return out

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise bad_request(f"prompts x n must not exceed {MAX_CHOICES}", "n")


class ContentPart(_Body):
    type: Annotated[str, Field(max_length=64)]
    text: str | None = None


class CalledFunction(_Body):
    name: Annotated[str, Field(max_length=512)]
    arguments: str  # JSON text, as OpenAI returns it


class MessageToolCall(_Body):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: Annotated[str, Field(max_length=512)]
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=4096)] | None = None
    name: Annotated[str, Field(max_length=512)] | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=1024)] | None = None
    tool_call_id: Annotated[str, Field(max_length=512)] | None = None


def message_fields(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Each message as the control plane's ChatMessage takes it: role and text content, and
    where present its name, tool calls (JSON) and the tool call it answers."""
    out = []
    for (role, content), m in zip(message_texts(messages), messages, strict=True):
        fields = {"role": role, "content": content}
        if m.name is not None:
            fields["name"] = m.name
        if m.tool_calls:
            fields["tool_calls_json"] = json.dumps(
                [c.model_dump() for c in m.tool_calls], ensure_ascii=False
            )
        if m.tool_call_id is not None:
            fields["tool_call_id"] = m.tool_call_id
        out.append(fields)
    return out


def message_texts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(role, content) pairs; text parts joined by newlines."""
    out: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            out.append((m.role, m.content or ""))
            continue
        texts = []
        for j, part in enumerate(m.content):
            param = f"messages.{i}.content.{j}"
            if part.type != "text":
                raise bad_request(
                    f"content parts of type {part.type!r} are not supported; send text",
                    f"{param}.type",
                )
            if part.text is None:
                raise bad_request("a text content part needs text", f"{param}.text")
            texts.append(part.text)
        out.append((m.role, "\n".join(texts)))
    return out


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class FunctionDefinition(_Body):
    name: Annotated[
        str,
        Field(
            pattern=f"^{TOOL_NAME.pattern}$",
            description="1 to 64 letters, digits, underscores or dashes; unique among the tools",
        ),
    ]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="The arguments' JSON schema; none: the function takes no arguments"
    )
    strict: bool | None = Field(
        None, description="Accepted; calls a tool_choice forces always follow the schema"
    )

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS

    def as_tool(self) -> dict[str, Any]:
        """The definition as a chat template reads it (`tools` of apply_chat_template)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters_schema
        return {"type": "function", "function": fn}


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[Tool], Field(max_length=128)]


def check_tools(tools: list[Tool]) -> None:
    """Unique names, and parameters that are JSON schemas."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise bad_request(
                f"tools {seen[fn.name]} and {i} are both called {fn.name!r}; names must be unique",
                f"tools.{i}.function.name",
            )
        seen[fn.name] = i
        if fn.parameters is not None:
            _schema_text(fn.parameters, f"tools.{i}.function.parameters")


def tools_json(tools: list[Tool]) -> str:
    """The tools as the chat template reads them (ChatPrompt.tools_json)."""
    return json.dumps([t.function.as_tool() for t in tools], ensure_ascii=False)


TemplateKwargs = Annotated[
    dict[str, Any] | None,
    Field(
        description="Extra variables for the chat template (vLLM's; e.g. a custom "
        "--chat-template's switches); not messages, tools or add_generation_prompt",
    ),
]


def template_kwargs_json(kwargs: dict[str, Any] | None) -> str:
    """chat_template_kwargs as ChatPrompt.chat_template_kwargs_json carries them."""
    return json.dumps(kwargs, ensure_ascii=False) if kwargs else ""


class ChatCompletionRequest(SamplingFields):
    MAX_COUNTS = {"messages": (MAX_MESSAGES, "messages")}

    messages: Messages
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    add_generation_prompt: bool = True
    tools: Tools | None = Field(
        None, description="Functions the model may call (OpenAI's function tools)"
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description='"auto" (the default with tools): the chat template shows the tools and '
        'the calls the model writes come back as tool_calls; "required": the output is one '
        'or more calls of the tools; {"type": "function", "function": {"name"}}: the output '
        'is that function\'s arguments; "none": the tools are left out',
    )
    parallel_tool_calls: bool = Field(True, description='false: "required" makes exactly one call')
    chat_template_kwargs: TemplateKwargs = None

    def effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        """Alternatives per token to ask the control plane for, or None for no logprobs."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def message_texts(self) -> list[tuple[str, str]]:
        return message_texts(self.messages)

    def beam_search_conflicts(self) -> list[tuple[str, Any]]:
        out = super().beam_search_conflicts()
        if self.logprobs:
            out.append(("logprobs", self.logprobs))
        return out

    def check(self) -> None:
        self._check_tools()
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.message_texts()

    def _check_tools(self) -> None:
        if self.tool_choice is not None and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        check_tools(self.tools or [])
        named = self.named_tool
        if named is not None and named not in self.tool_names:
            raise bad_request(
                f"tool_choice names function {named!r}, which is not among the tools",
                "tool_choice.function.name",
            )

    @property
    def tool_mode(self) -> Literal["auto", "required", "function"] | None:
        """None without tools or with tool_choice "none"; "function" for a named one."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice is None:
            return "auto"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice

    @property
    def named_tool(self) -> str | None:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    def tools_json(self) -> str:
        """The tools for the chat template: only with tool_choice "auto"."""
        if self.tool_mode != "auto":
            return ""
        assert self.tools is not None
        return tools_json(self.tools)

    def constraints(self) -> list[Constraint]:
        out = super().constraints()
        mode = self.tool_mode
        if mode == "required":
            assert self.tools is not None
            tools = [(t.function.name, t.function.parameters_schema) for t in self.tools]
            schema = required_schema(tools, self.parallel_tool_calls)
            spec = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
            out.append(Constraint("tool_choice", "json_schema", spec))
        elif mode == "function":
            [fn] = [t.function for t in self.tools or [] if t.function.name == self.named_tool]
            spec = json.dumps(fn.parameters_schema, ensure_ascii=False, separators=(",", ":"))
            out.append(Constraint("tool_choice", "json_schema", spec))
        return out


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered with the chat template."""

    MAX_COUNTS = {"messages": (MAX_MESSAGES, "messages")}

    model: Annotated[str, Field(max_length=512)] | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Messages | None = None
    # Default: true for a prompt, false for messages (the chat template writes its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: TemplateKwargs = None
    tools: Tools | None = Field(
        None, description='With messages: rendered by the chat template, as chat\'s "auto"'
    )

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send either prompt or messages", "prompt")
        if self.messages is None:
            if self.tools:
                raise bad_request("tools go with messages, not a prompt", "tools")
            return
        for name in ("continue_final_message", "chat_template"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported", name)
        check_tools(self.tools or [])
        if self.add_special_tokens:
            raise bad_request(
                "add_special_tokens with messages is not supported: the chat template writes "
                "the special tokens",
                "add_special_tokens",
            )
        message_texts(self.messages)


class DetokenizeRequest(_Request):
    MAX_COUNTS = {"tokens": (MAX_PROMPT_TOKEN_IDS, "token ids")}

    model: Annotated[str, Field(max_length=512)] | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]

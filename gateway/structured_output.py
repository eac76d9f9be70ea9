"""Output constraints on the HTTP side: the request fields that ask for one (OpenAI's
`response_format`, vLLM's `guided_*` and `structured_outputs`), the `Constraint` each becomes,
and its protobuf. A request takes at most one (`SamplingFields.output_constraint`); the
control plane compiles it into a grammar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from pydantic import Field

from gateway.errors import bad_request
from gateway.json_schema import schema_text
from gateway.protocol import Body
from protos.v1 import common_pb2

NonEmptyStr = Annotated[str, Field(min_length=1)]
ChoiceList = Annotated[list[NonEmptyStr], Field(min_length=1)]
SchemaOrText = dict[str, Any] | str


class JsonSchemaFormat(Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema the output is an instance of"
    )
    strict: bool | None = Field(
        None, description="Accepted; the output always follows the schema (compact JSON)"
    )


class ResponseFormat(Body):
    """OpenAI's: plain `text`, any JSON object, or an instance of a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: SchemaOrText | None = Field(
        None, alias="json", description="A JSON schema (or a string holding one)"
    )
    regex: NonEmptyStr | None = None
    choice: ChoiceList | None = None
    grammar: NonEmptyStr | None = Field(None, description="An EBNF grammar (`root ::= ...`)")
    json_object: bool | None = None


@dataclass(frozen=True)
class Constraint:
    """What the output must match, and the request field that asked for it. `kind` and
    `spec` as `pagedserve.sampling_params.StructuredOutput` takes them."""

    param: str
    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: str = ""
    choices: tuple[str, ...] = ()


class ConstraintFields(Protocol):
    """The request fields that ask for an output constraint."""

    @property
    def response_format(self) -> ResponseFormat | None: ...
    @property
    def guided_json(self) -> SchemaOrText | None: ...
    @property
    def guided_regex(self) -> str | None: ...
    @property
    def guided_choice(self) -> list[str] | None: ...
    @property
    def guided_grammar(self) -> str | None: ...
    @property
    def structured_outputs(self) -> StructuredOutputs | None: ...


def requested_constraints(body: ConstraintFields) -> list[Constraint]:
    """Every output constraint the fields ask for, in the order they are listed; a 400 for a
    JSON schema that is none."""
    out: list[Constraint] = []
    rf = body.response_format
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
        spec = schema_text(rf.json_schema.schema_, param)
        out.append(Constraint(param, "json_schema", spec))
    if body.guided_json is not None:
        spec = schema_text(body.guided_json, "guided_json")
        out.append(Constraint("guided_json", "json_schema", spec))
    if body.guided_regex is not None:
        out.append(Constraint("guided_regex", "regex", body.guided_regex))
    if body.guided_choice is not None:
        out.append(Constraint("guided_choice", "choice", choices=tuple(body.guided_choice)))
    if body.guided_grammar is not None:
        out.append(Constraint("guided_grammar", "grammar", body.guided_grammar))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            param = "structured_outputs.json"
            out.append(Constraint(param, "json_schema", schema_text(so.json_, param)))
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


def constraint_proto(c: Constraint) -> common_pb2.StructuredOutput:
    msg = common_pb2.StructuredOutput()
    if c.kind == "json_object":
        msg.json_object = True
    elif c.kind == "choice":
        msg.choice.choices.extend(c.choices)
    else:
        setattr(msg, c.kind, c.spec)
    return msg

"""What every request body shares, validated before anything reaches the control plane.

Types are strict (no "5" for 5) and the sampling ranges are `pagedserve.sampling_params.RANGES`,
the table `SamplingParams` checks too (`bounded`), so what passes here is rejected upstream
only for what needs the model: prompt length, vocabulary, context. A body's `check()` covers the
rules that span fields or name features the gateway does not offer. Each endpoint's body
lives beside its route (`gateway.completion.protocol`, `gateway.chat_completion.protocol`,
`gateway.tokenize.protocol`).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    model_validator,
)
from pydantic.fields import FieldInfo

from gateway.errors import bad_request
from pagedserve.json_values import check_json_value
from pagedserve.sampling_params import FLOAT32_TINY, RANGES, UINT32_MAX

# Token ids in one prompt (or one /detokenize): more than any served context holds, so a longer
# list is refused by its length before its ids are looked at.
MAX_PROMPT_TOKEN_IDS = 1 << 20


def _integral(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer; so do we (5.5 still fails)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Constraints go before the validator: that way they also reach the JSON schema.
INTEGRAL = BeforeValidator(_integral)
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX), INTEGRAL]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
ModelName = Annotated[str, Field(max_length=512)]


def bounded(name: str, **kwargs: Any) -> FieldInfo:
    """A Field bounded by sampling parameter `name`'s range (`RANGES`), with `kwargs`. An open
    end becomes the nearest value the wire carries: the next integer, or for a float's 0,
    float32's smallest normal number (a smaller positive value is no longer one in the
    control plane's float32)."""
    r = RANGES[name]
    low, high = r.low, r.high
    if r.low_open:
        assert low == 0.0 and isinstance(low, float), name
        low = FLOAT32_TINY
    if r.high_open:
        assert isinstance(high, int), name
        high -= 1
    return Field(ge=low, le=high, **kwargs)


@functools.cache
def _known_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The names a request body of `cls` may carry (aliases where set)."""
    return frozenset(f.alias or name for name, f in cls.model_fields.items())


class Body(BaseModel):
    """A request body or a part of one."""

    # Unknown fields are ignored, as vLLM does; the routes log their names.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, Body):
            known = _known_fields(cls)
            model._ignored = [k for k in data if k not in known]
        return model

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Dotted paths of the request's fields that were dropped as unknown."""
        out = [prefix + k for k in self._ignored]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, Body):
                out += value.ignored_fields(f"{prefix}{name}.")
            elif value and isinstance(value, list) and isinstance(value[0], Body):
                # A list holds models or none (never a million token ids walked here).
                for i, item in enumerate(value):
                    out += item.ignored_fields(f"{prefix}{name}.{i}.")
        return out


class RequestBody(Body):
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
            check_count(name, data.get(name), limit, items)

    def check(self) -> None:
        """The rules that span fields (a 400); none here."""


def check_count(param: str, value: Any, limit: int, items: str) -> None:
    """400 for a list `value` longer than `limit`, looking at none of its items."""
    if isinstance(value, list) and len(value) > limit:
        raise bad_request(f"{param}: {len(value)} {items}, more than the limit of {limit}", param)

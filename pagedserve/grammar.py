"""Structured output: a request's constraint (`StructuredOutput`) compiled into a grammar over
the model's vocabulary, and a matcher per request that says, before each token, which tokens
keep the text inside it (llguidance: an Earley parser over a lazily built lexer, so a grammar
is ready in about a millisecond, however large its schema, and a step's mask costs tens of
microseconds a row).

Both planes build grammars: the control plane checks a constraint at admission without the
vocabulary, so that one that does not compile is refused (INVALID_ARGUMENT) before it reaches
a worker, and the worker builds a matcher over its vocabulary when a constrained request first
arrives (each process caches by constraint, a refusal too). JSON schemas compile with compact
separators and no free whitespace, so a model cannot wander into endless blanks; generation
is narrower than what the schema validates in four more ways, each so that a small model
cannot wander either: an object that does not say otherwise admits no properties beyond those
it lists (as OpenAI's strict mode), a string `pattern` is matched whole, a number has at
most six digits after the point, and a `date` or `date-time` skips February 29 (a grammar
cannot tell leap years). The stop tokens are the model's EOS ids: the mask allows
them exactly where the text is complete, so a constrained output ends with EOS there (or at
max_tokens).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from pagedserve import grammar_bounds
from pagedserve.sampling_params import InvalidRequestError, StructuredOutput

if TYPE_CHECKING:  # the masks are the worker's; the control plane runs without torch
    import torch

# Compiled grammars (and refusals) kept per process.
CACHE_SIZE = 512
# Threads a step's mask filling may use.
GRAMMAR_THREADS = 2
_FIELD = {
    "json_schema": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
# JSON output: no whitespace between tokens; a schema's own "x-guidance" cannot turn it on.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
# A generated number is a multiple of this: at most six digits after the point, no exponent.
NUMBER_STEP = 1e-6
# RFC 3339 dates of years 1000-9999 without the leap day (a regex cannot tell leap years), and
# date-times with at most six fraction digits: each a subset of its format, so every match
# validates.
_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = f"[1-9][0-9]{{3}}-{_DAY}"
_DATE_PATTERNS = {
    "date": f"^{_DATE}$",
    "date-time": (
        f"^{_DATE}T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{{1,6}})?"
        "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])$"
    ),
}
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")  # fmt: skip


def vocab_tokenizer(model_path: str | Path) -> Tokenizer:
    """The model's tokenizer as the control plane loads it: the GGUF's vocabulary, or
    tokenizer.json."""
    from pagedserve.gguf import find_gguf, open_gguf

    gguf_file = find_gguf(model_path)
    if gguf_file is not None:
        tok: Tokenizer = open_gguf(gguf_file).tokenizer()
        return tok
    return Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))


def _strict(schema: Any) -> Any:
    """A copy of a JSON schema in which every object without `additionalProperties` admits no
    other properties, every `pattern` is anchored at both ends (JSON Schema's pattern is a
    search; an output matching the whole pattern satisfies it all the same), and a number has
    at most six digits after the point (JSON Schema bounds none: at greedy a small model can
    repeat a digit until max_tokens)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = _strict(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    is_object = out.get("type") == "object" or (
        isinstance(out.get("type"), list) and "object" in out["type"]
    )
    if (is_object or "properties" in out) and "additionalProperties" not in out:
        if "patternProperties" not in out and "unevaluatedProperties" not in out:
            out["additionalProperties"] = False
    if out.get("format") in _DATE_PATTERNS and "pattern" not in out:
        out["pattern"] = _DATE_PATTERNS[out.pop("format")]
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _anchor(out["pattern"])
    kinds: list[Any] = out["type"] if isinstance(out.get("type"), list) else [out.get("type")]
    if "number" in kinds and "multipleOf" not in out:
        out["multipleOf"] = NUMBER_STEP
    return out


def _anchor(pattern: str) -> str:
    """The pattern matched whole: ^(?:body)$, its own outer anchors dropped (whatever matches
    the result matches the pattern)."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    return f"^(?:{body})$"


def grammar_text(constraint: StructuredOutput) -> str:
    """The constraint as an llguidance grammar; InvalidRequestError if it cannot be one, or
    if it is past a bound of `grammar_bounds` (what the library's compiler can take)."""
    import llguidance as llg

    c = constraint
    grammar_bounds.bound(c.kind, _FIELD[c.kind], c.spec)
    try:
        if c.kind == "json_schema":
            return str(
                llg.LLMatcher.grammar_from_json_schema(
                    _strict(json.loads(c.spec)), overrides=_JSON_OPTIONS
                )
            )
        if c.kind == "json_object":
            return str(
                llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
            )
        if c.kind == "choice":
            return str(llg.grammar_from("choice", json.dumps(c.choice_list, ensure_ascii=False)))
        return str(llg.grammar_from(c.kind, c.spec))  # regex; grammar: GBNF or Lark
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _refusal(constraint, str(exc)) from None


def check(constraint: StructuredOutput) -> None:
    """Builds a constraint's grammar without the vocabulary (about a millisecond): a schema,
    regex or grammar that cannot compile fails here. InvalidRequestError naming the field and
    the reason."""
    import llguidance as llg

    text = grammar_text(constraint)
    error = grammar_bounds.on_deep_stack(llg.LLMatcher.validate_grammar, text)
    if error:
        raise _refusal(constraint, error)


def _refusal(constraint: StructuredOutput, message: str) -> InvalidRequestError:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines[:3])[:300]
    return InvalidRequestError(f"{_FIELD[constraint.kind]} does not compile: {text or 'invalid'}")


class GrammarCompiler:
    """Builds matchers for one vocabulary; thread-safe; caches a matcher at the start of each
    constraint's grammar (a refusal too, so a bad constraint sent again costs nothing)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        import llguidance as llg

        self.vocab_size = vocab_size
        self._stop_token_ids = frozenset(stop_token_ids)
        self._llg = llg
        self._tokenizer = llg.LLTokenizer(
            tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._compiling: dict[StructuredOutput, Future[Any]] = {}
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutput) -> Any:
        """A matcher at the start of the constraint's grammar (copied for each request);
        InvalidRequestError naming the field and the reason. A constraint being compiled by
        another thread is waited for, not compiled twice."""
        pending: Future[Any] = Future()
        mine = False
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
            elif constraint in self._compiling:
                pending = self._compiling[constraint]
            else:
                self._compiling[constraint] = pending
                mine = True
        if hit is None:
            if not mine:
                hit = pending.result()
            else:
                try:
                    hit = self._compile(constraint)
                except InvalidRequestError as exc:
                    hit = exc
                except BaseException as exc:
                    with self._lock:
                        del self._compiling[constraint]
                    pending.set_exception(exc)
                    raise
                with self._lock:
                    self._cache[constraint] = hit
                    while len(self._cache) > CACHE_SIZE:
                        self._cache.popitem(last=False)
                    del self._compiling[constraint]
                pending.set_result(hit)
        if isinstance(hit, InvalidRequestError):
            raise hit
        return hit

    def _compile(self, constraint: StructuredOutput) -> Any:
        text = grammar_text(constraint)
        matcher = grammar_bounds.on_deep_stack(
            self._llg.LLMatcher, self._tokenizer, text, log_level=0
        )
        if matcher.is_error():
            raise _refusal(constraint, matcher.get_error())
        return matcher

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        return Matcher(self.compile(constraint).deep_copy(), self._stop_token_ids)


class Matcher:
    """Where one request's output stands in its grammar."""

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int], ended: bool = False) -> None:
        self._m = matcher
        self._stops = stop_token_ids
        self._ended = ended

    def accept(self, token_id: int) -> bool:
        """Advances past a token; False if the grammar does not allow it (the matcher then
        allows nothing more)."""
        ok = bool(self._m.consume_token(token_id))
        self._ended = ok and token_id in self._stops
        return ok

    def error(self) -> str | None:
        """Why the grammar library cannot go on (a limit of its parser reached, a token it
        does not allow consumed), or None. In that state its masks allow only the stop tokens:
        the output must not be taken for a complete one."""
        if not self._m.is_error():
            return None
        lines = [line.strip() for line in self._m.get_error().splitlines() if line.strip()]
        return " ".join(lines[:1])[:300] or "the grammar stopped"

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing may follow. (Where the text is complete but no
        stop token came yet, the stop tokens are all that is allowed.)"""
        return self._ended

    def fork(self) -> Matcher:
        """An independent copy, at the same place."""
        return Matcher(self._m.deep_copy(), self._stops, self._ended)


_executor: Any = None
_executor_lock = threading.Lock()


def token_bitmask(matchers: Sequence[Matcher], vocab: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab / 32)] int32: bit i of word w set where matchers[row] allows
    token 32w + i next; filled in parallel, outside the GIL."""
    import torch

    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                import llguidance as llg

                _executor = llg.LLExecutor(num_threads=GRAMMAR_THREADS)
    words = (vocab + 31) // 32
    bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
    _executor.unsafe_compute_mask_ptr(
        [(m._m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(matchers)
    )
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool from token_bitmask's words."""
    import torch

    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab]).bool()


def allowed_tokens(matchers: Sequence[Matcher], vocab: int) -> torch.Tensor:
    """[len(matchers), vocab] bool: the tokens each matcher allows next."""
    return unpack_bitmask(token_bitmask(matchers, vocab), vocab)

"""Structured-output grammar backends compared: xgrammar and llguidance on the default model's
vocabulary (SmolLM2-135M-Instruct, 49,152 tokens), on the constraints of tests/json_schemas.py.

Per constraint (JSON schemas, regexes, choice lists, EBNF grammars) and backend:

    compile      cold: a new compiler (xgrammar) / a new matcher (llguidance) each time, no
                 cache; the median of --reps; a failure is a coverage gap (its error is kept)
    walk         a fresh matcher steps through the tokens of a valid example (its compact JSON
                 for a schema) then EOS: before each token the next-token bitmask is filled and
                 the token checked against it, then the token is accepted. Per token: fill +
                 accept, in microseconds. "cold" is the first walk of a freshly compiled
                 grammar (llguidance builds lexer states lazily, in this walk), "warm" a second
                 walk after reset() (the best of three)
    fork         the cost of a new matcher for another request of the same constraint:
                 xgrammar GrammarMatcher(compiled), llguidance LLMatcher.deep_copy()

Then: applying a [rows, 49152] bitmask to float32 logits on the CPU with each library's helper
(and a plain torch unpack for reference); feature probes (does each backend enforce maxLength,
formats, exclusiveMinimum, ... : a valid instance accepted, an invalid one refused); whether a
compile releases the GIL.

Compiles and walks are timed by the calling thread's CPU time (--clock wall: wall clock), so
that other work on a shared machine barely moves them; mask application and batch fills by the
wall clock (the least of five loops).

Backends: `xgrammar` (GrammarCompiler, masks precomputed at compile), `xgrammar_lazy` (the same
with enable_dynamic_compilation=True: masks built on first use) and `llguidance` (LLMatcher).

    python -m benchmarks.grammar_backends
    python -m benchmarks.grammar_backends --quick          # benchmark schemas only, 1 rep
    python -m benchmarks.grammar_backends --backends xgrammar,llguidance --reps 5
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, format_table, machine, model_dir, write_json
from tests.json_schemas import (
    BENCHMARK_SCHEMAS,
    CHOICES,
    GRAMMAR_EXAMPLES,
    GRAMMARS,
    REGEX_EXAMPLES,
    REGEXES,
    SCHEMA_EXAMPLES,
    SCHEMAS,
    TWENTY_PROPERTY_SCHEMA,
)

BACKENDS = ("xgrammar", "xgrammar_lazy", "llguidance")


# Compiles and walks run on the calling thread (xgrammar with max_threads=1): timed by that
# thread's CPU time, which other processes on a shared machine barely change; --clock wall
# times them by the wall clock instead. Mask application and batch fills are wall-clock.
clock: Callable[[], int] = time.thread_time_ns


def _ms(ns: float) -> float:
    return ns / 1e6


def _us(ns: float) -> float:
    return ns / 1e3


# -- backends -------------------------------------------------------------------------------------


class Backend:
    """One library behind the calls the engine makes: compile a constraint, make a matcher,
    fill a bitmask row, accept a token, reset, fork, and say whether it terminated."""

    name: str
    version: str

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        t0 = time.perf_counter_ns()
        self._setup(tokenizer)
        self.setup_ms = _ms(time.perf_counter_ns() - t0)

    def _setup(self, tokenizer: Any) -> None:
        raise NotImplementedError

    def compile(self, kind: str, spec: Any) -> Any:
        """The compiled constraint (cold); raises on a constraint it cannot compile."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        """A matcher at the start of `compiled` (for llguidance the compiled object is one)."""
        raise NotImplementedError

    def fork(self, m: Any) -> Any:
        raise NotImplementedError

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def accept(self, m: Any, token: int) -> bool:
        raise NotImplementedError

    def reset(self, m: Any) -> None:
        m.reset()

    def terminated(self, m: Any) -> bool:
        raise NotImplementedError


def choice_ebnf(options: Sequence[str]) -> str:
    """A choice list as an EBNF grammar (xgrammar has no choice constraint of its own)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def xgr_tokenizer_info(
    tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], blank_special: bool = True
) -> Any:
    """xgrammar's TokenizerInfo from a `tokenizers.Tokenizer`, without transformers.

    With `blank_special`, the special added tokens (<|im_start|>, <|endoftext|>, ...) get an
    empty text, which xgrammar treats as a special token that no grammar position allows:
    otherwise (and with `TokenizerInfo.from_huggingface`, on this vocabulary) their literal text
    is allowed inside free JSON strings. The stop tokens are given explicitly.
    """
    import xgrammar as xgr

    encoded = [""] * vocab_size
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = text
    if blank_special:
        for i, added in tokenizer.get_added_tokens_decoder().items():
            if added.special and i < vocab_size:
                encoded[i] = ""
    # vocab_type (byte-level / byte-fallback / raw) and add_prefix_space, from tokenizer.json's
    # decoder and pre-tokenizer (the same detection from_huggingface runs).
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(eos_ids),
        add_prefix_space=meta["add_prefix_space"],
    )


class XGrammar(Backend):
    name = "xgrammar"
    dynamic = False

    def __init__(self, *args: Any, threads: int = 1) -> None:
        self.threads = threads
        super().__init__(*args)

    def _setup(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.version = _dist_version("xgrammar")
        self.info = xgr_tokenizer_info(tokenizer, self.vocab_size, self.eos_ids)

    def new_compiler(self) -> Any:
        return self.xgr.GrammarCompiler(
            self.info,
            max_threads=self.threads,
            cache_enabled=False,
            enable_dynamic_compilation=self.dynamic,
        )

    def compile(self, kind: str, spec: Any, compiler: Any = None) -> Any:
        c = compiler or self.new_compiler()
        if kind == "json":
            return c.compile_json_schema(
                json.dumps(spec), any_whitespace=False, separators=(",", ":"), strict_mode=True
            )
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar(choice_ebnf(spec))
        if kind == "grammar":
            return c.compile_grammar(spec)
        raise ValueError(kind)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fork(self, m: Any) -> Any:
        return m.fork()

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def terminated(self, m: Any) -> bool:
        return bool(m.is_terminated())


class XGrammarLazy(XGrammar):
    name = "xgrammar_lazy"
    dynamic = True


class LLGuidance(Backend):
    name = "llguidance"

    def _setup(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.version = llguidance.__version__
        # tokenizer.json's text; no transformers needed.
        self.tok = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids
        )

    def grammar(self, kind: str, spec: Any) -> str:
        llg = self.llg
        if kind == "json":
            # `overrides`: a schema's own "x-guidance" cannot turn free whitespace back on.
            return llg.LLMatcher.grammar_from_json_schema(
                spec, overrides={"whitespace_flexible": False}
            )
        if kind == "regex":
            return llg.grammar_from("regex", spec)
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(spec))
        if kind == "grammar":
            return llg.grammar_from("grammar", spec)  # GBNF -> Lark
        raise ValueError(kind)

    def compile(self, kind: str, spec: Any) -> Any:
        m = self.llg.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled

    def fork(self, m: Any) -> Any:
        return m.deep_copy()

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llg_torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def terminated(self, m: Any) -> bool:
        return bool(m.is_stopped()) and not m.is_error()


def _dist_version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Backend:
    cls = {"xgrammar": XGrammar, "xgrammar_lazy": XGrammarLazy, "llguidance": LLGuidance}[name]
    return cls(tokenizer, vocab_size, eos_ids)


# -- measurements ---------------------------------------------------------------------------------


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    word = int(bitmask[row, token // 32])
    return bool((word >> (token % 32)) & 1)


_VOCAB_BYTES: list[bytes] = []


def vocab_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Each token's bytes (llguidance's decoder: exact for partial UTF-8 tokens)."""
    if not _VOCAB_BYTES:
        try:
            import llguidance

            tok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size)
            _VOCAB_BYTES.extend(tok.decode_bytes([i]) for i in range(vocab_size))
        except ImportError:
            _VOCAB_BYTES.extend(tokenizer.decode([i]).encode() for i in range(vocab_size))
    return _VOCAB_BYTES


def walk(b: Backend, m: Any, text: str, tokenizer: Any, bitmask: torch.Tensor) -> dict[str, Any]:
    """Generate `text` then EOS through the matcher: before each token fill the mask, then
    accept the token. The token is the tokenizer's next token of the rest of the text when the
    mask allows it; otherwise (a "detour": llguidance, where the grammar forces bytes, allows
    only their canonical tokenization, e.g. `"` + `}}` where BPE of the whole text has `"}`)
    the longest allowed token that the rest of the text starts with."""
    vb = vocab_bytes(tokenizer, b.vocab_size)
    data = text.encode()
    pos = 0
    pending = list(tokenizer.encode(text, add_special_tokens=False).ids)
    fill_ns: list[int] = []
    accept_ns: list[int] = []
    detours = 0
    error = None
    eos = b.eos_ids[0]
    while True:
        t0 = clock()
        b.fill(m, bitmask, 0)
        t1 = clock()
        if pos == len(data):
            t = eos
            if not allowed(bitmask, 0, t):
                error = "EOS not in the mask at the end"
                break
        else:
            t = pending[0] if pending else -1
            if t < 0 or not allowed(bitmask, 0, t):
                rest = data[pos:]
                fits = [
                    i
                    for i in range(b.vocab_size)
                    if vb[i] and rest.startswith(vb[i]) and allowed(bitmask, 0, i)
                ]
                if not fits:
                    error = f"nothing allowed at byte {pos} ({rest[:12]!r})"
                    break
                t = max(fits, key=lambda i: len(vb[i]))
                detours += 1
                pending = []
        t2 = clock()
        ok = b.accept(m, t)
        t3 = clock()
        fill_ns.append(t1 - t0)
        accept_ns.append(t3 - t2)
        if not ok:
            error = f"token {t} refused at byte {pos}"
            break
        if t == eos:
            break
        pos += len(vb[t])
        if pending:
            pending.pop(0)
        elif pos < len(data):
            pending = list(tokenizer.encode(data[pos:].decode(), add_special_tokens=False).ids)
    if error is None and not b.terminated(m):
        error = "not terminated after EOS"
    steps = len(fill_ns)
    total = [f + a for f, a in zip(fill_ns, accept_ns, strict=True)]
    return {
        "ok": error is None,
        "error": error,
        "steps": steps,
        "detours": detours,
        "fill_us": _us(statistics.fmean(fill_ns)) if steps else None,
        "accept_us": _us(statistics.fmean(accept_ns)) if steps else None,
        "per_token_us": _us(statistics.fmean(total)) if steps else None,
        "per_token_p50_us": _us(statistics.median(total)) if steps else None,
        "per_token_max_us": _us(max(total)) if steps else None,
    }


def measure_constraint(
    b: Backend, kind: str, name: str, spec: Any, text: str, tokenizer: Any, reps: int
) -> dict[str, Any]:
    row: dict[str, Any] = {"backend": b.name, "kind": kind, "name": name}
    times: list[int] = []
    compiled = None
    try:
        for _ in range(reps):
            if isinstance(b, XGrammar):
                compiler = b.new_compiler()  # outside the timing: a cold compiler per compile
                t0 = clock()
                compiled = b.compile(kind, spec, compiler)
            else:
                t0 = clock()
                compiled = b.compile(kind, spec)
            times.append(clock() - t0)
    except Exception as exc:  # noqa: BLE001 - any failure is a coverage gap to report
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        return row
    row.update(
        ok=True,
        compile_ms=_ms(statistics.median(times)),
        compile_ms_first=_ms(times[0]),
        compile_ms_all=[round(_ms(t), 3) for t in times],
    )
    row["tokens"] = len(tokenizer.encode(text, add_special_tokens=False).ids)
    bitmask = torch.full((1, (b.vocab_size + 31) // 32), -1, dtype=torch.int32)

    t0 = clock()
    m = b.matcher(compiled)
    row["matcher_us"] = _us(clock() - t0)
    t0 = clock()
    spare = b.fork(m)  # of a matcher at the start, before any walk
    row["fork_us"] = _us(clock() - t0)
    del spare

    cold = walk(b, m, text, tokenizer, bitmask)
    walks = []
    for _ in range(3):  # the best of three: this machine's other work only adds time
        b.reset(m)
        walks.append(walk(b, m, text, tokenizer, bitmask))
    failed = [w for w in walks if not w["ok"]]
    warm = failed[0] if failed else min(walks, key=lambda w: w["per_token_us"])
    row["walk_ok"] = cold["ok"] and warm["ok"]
    row["walk_error"] = cold["error"] or warm["error"]
    row["cold"] = cold
    row["warm"] = warm
    return row


def anchored(schema: Any) -> Any:
    """`schema` with every unanchored `pattern` anchored (^(...)$). JSON Schema's pattern is a
    search: llguidance honours that (so "[0-9]{4}" allows any text around the digits, without
    bound), xgrammar matches a pattern whole whatever its anchors."""
    if isinstance(schema, list):
        return [anchored(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: anchored(v) for k, v in schema.items()}
    pat = schema.get("pattern")
    if isinstance(pat, str) and not (pat.startswith("^") and pat.endswith("$")):
        out["pattern"] = f"^({pat})$"
    return out


ANCHOR = True


def constraints(quick: bool) -> list[tuple[str, str, Any, str]]:
    """(kind, name, spec, example text) of every constraint measured."""
    out: list[tuple[str, str, Any, str]] = []
    for name, schema in SCHEMAS:
        if quick and name not in BENCHMARK_SCHEMAS:
            continue
        if ANCHOR:
            schema = anchored(schema)
        text = json.dumps(SCHEMA_EXAMPLES[name], separators=(",", ":"))
        out.append(("json", name, schema, text))
    for name, regex in REGEXES:
        out.append(("regex", name, regex, REGEX_EXAMPLES[name]))
    for name, options in CHOICES:
        out.append(("choice", name, options, options[len(options) // 2]))
    for name, ebnf in GRAMMARS:
        out.append(("grammar", name, ebnf, GRAMMAR_EXAMPLES[name]))
    return out


# Each probe: (feature, schema, instance that must be accepted, instance that must be refused).
# An instance is compact JSON text; None: not probed.
FEATURE_PROBES: list[tuple[str, dict[str, Any], str | None, str | None]] = [
    ("maxLength", {"type": "string", "maxLength": 5}, '"abc"', '"abcdefgh"'),
    ("minLength", {"type": "string", "minLength": 3}, '"abcd"', '"a"'),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}$"}, '"ABC"', '"ABCD"'),
    ("pattern \\d", {"type": "string", "pattern": "^\\d{3}$"}, '"123"', '"12a"'),
    (
        "pattern + maxLength",
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4},
        '"abc"',
        '"abcdefg"',
    ),
    ("format date", {"type": "string", "format": "date"}, '"2024-02-29"', '"2024-13-01"'),
    (
        "format date-time",
        {"type": "string", "format": "date-time"},
        '"2024-02-29T12:00:00Z"',
        '"2024-02-29 12:00"',
    ),
    ("format time", {"type": "string", "format": "time"}, '"12:30:00Z"', '"25:00:00Z"'),
    ("format email", {"type": "string", "format": "email"}, '"a.b@example.com"', '"not email"'),
    (
        "format email + maxLength",
        {"type": "string", "format": "email", "maxLength": 12},
        '"a@b.co"',
        '"abcdefghij@example.com"',
    ),
    (
        "format uuid",
        {"type": "string", "format": "uuid"},
        '"3f2b8c1e-9d4a-4c6b-8e2f-1a7d5c9b0e43"',
        '"3f2b8c1e"',
    ),
    ("format ipv4", {"type": "string", "format": "ipv4"}, '"10.0.0.1"', '"300.1.1.1"'),
    ("format ipv6", {"type": "string", "format": "ipv6"}, '"::1"', '"1:2:3"'),
    ("format hostname", {"type": "string", "format": "hostname"}, '"a.example.com"', '"a..b"'),
    ("format uri", {"type": "string", "format": "uri"}, '"https://a.io/x"', '"not a uri"'),
    ("integer min/max", {"type": "integer", "minimum": 1, "maximum": 99}, "42", "150"),
    ("integer negative range", {"type": "integer", "minimum": -5, "maximum": 5}, "-3", "-7"),
    ("number min/max", {"type": "number", "minimum": 0, "maximum": 1}, "0.5", "1.5"),
    ("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "0.5", "0"),
    ("integer exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 10}, "9", "10"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "15", "7"),
    ("enum", {"enum": ["a", "b"]}, '"a"', '"c"'),
    ("const", {"const": "x"}, '"x"', '"y"'),
    ("const number", {"const": 2}, "2", "3"),
    (
        "maxItems",
        {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        "[1,2]",
        "[1,2,3]",
    ),
    ("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1}, "[1]", "[]"),
    (
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "[1,2]",
        "[1,1]",
    ),
    (
        "required",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
        '{"a":1,"b":2}',
        '{"a":1}',
    ),
    (
        "optional property skipped",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["b"],
        },
        '{"b":2}',
        None,
    ),
    (
        "additionalProperties false",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        '{"a":1}',
        '{"a":1,"z":2}',
    ),
    (
        "additional property (schema allows it)",
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        '{"a":1,"z":2}',
        None,
    ),
    (
        "key order: out of order",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
        '{"b":2,"a":1}',
        None,
    ),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"s"'),
    (
        "oneOf",
        {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
        '"ab"',
        '"abcd"',
    ),
    ("type [string, null]", {"type": ["string", "null"], "maxLength": 3}, "null", "5"),
    (
        "$ref / $defs",
        {"$defs": {"p": {"type": "integer", "maximum": 3}}, "$ref": "#/$defs/p"},
        "2",
        "7",
    ),
    (
        "recursive $ref",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
        '{"v":1,"children":[{"v":2}]}',
        '{"v":1,"children":[{"v":"x"}]}',
    ),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "5", "1"),
    ("not", {"not": {"type": "integer"}}, '"a"', "1"),
    (
        "minProperties / maxProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        '{"a":1}',
        '{"a":1,"b":2}',
    ),
]


def run_text(b: Backend, compiled: Any, tokens: Sequence[int]) -> bool:
    """Whether a fresh matcher accepts `tokens` and then EOS, ending terminated."""
    m = b.fork(b.matcher(compiled)) if isinstance(b, LLGuidance) else b.matcher(compiled)
    for t in [*tokens, b.eos_ids[0]]:
        if not b.accept(m, t):
            return False
    return b.terminated(m)


def feature_probes(b: Backend, tokenizer: Any) -> list[dict[str, Any]]:
    rows = []
    for feature, schema, good, bad in FEATURE_PROBES:
        row: dict[str, Any] = {"backend": b.name, "feature": feature}
        try:
            compiled = b.compile("json", schema)
        except Exception as exc:  # noqa: BLE001
            row.update(compiles=False, error=f"{type(exc).__name__}: {str(exc).strip()[:200]}")
            rows.append(row)
            continue
        row["compiles"] = True

        def enc(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False).ids)

        row["valid_accepted"] = run_text(b, compiled, enc(good)) if good is not None else None
        row["invalid_refused"] = (not run_text(b, compiled, enc(bad))) if bad is not None else None
        rows.append(row)
    return rows


def gil_probe(b: Backend, kind: str, spec: Any, seconds: float = 0.0) -> dict[str, Any]:
    """Compile in a thread while this one counts: the count's rate relative to counting alone
    (about 1.0 when the compile runs without the GIL, about 0 when it holds it)."""

    def count_for(stop: Callable[[], bool]) -> tuple[int, float]:
        n = 0
        t0 = time.perf_counter()
        while not stop():
            n += 1
        return n, time.perf_counter() - t0

    deadline = time.perf_counter() + 0.2
    n0, dt0 = count_for(lambda: time.perf_counter() > deadline)
    alone = n0 / dt0
    done = threading.Event()

    def target() -> None:
        try:
            for _ in range(3):
                b.compile(kind, spec)
        finally:
            done.set()

    th = threading.Thread(target=target)
    th.start()
    n1, dt1 = count_for(done.is_set)
    th.join()
    return {
        "backend": b.name,
        "compile_s": dt1,
        "main_thread_rate_vs_alone": (n1 / dt1) / alone if dt1 > 0 else None,
    }


def batch_fill(b: Backend, tokenizer: Any, rows: int = 16) -> dict[str, Any]:
    """One step's masks for `rows` matchers (the benchmark schemas, each row at its own point
    of its example): filled one by one, and with the library's parallel batch call."""
    import os

    matchers = []
    for i in range(rows):
        name = BENCHMARK_SCHEMAS[i % len(BENCHMARK_SCHEMAS)]
        text = json.dumps(SCHEMA_EXAMPLES[name], separators=(",", ":"))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        schema = dict(SCHEMAS)[name]
        m = b.matcher(b.compile("json", anchored(schema) if ANCHOR else schema))
        for t in ids[: (i * 7 + 3) % len(ids)]:
            assert b.accept(m, t)
        matchers.append(m)
    bitmask = torch.full((rows, (b.vocab_size + 31) // 32), -1, dtype=torch.int32)
    threads = os.cpu_count() or 1

    def seq() -> None:
        for i, m in enumerate(matchers):
            b.fill(m, bitmask, i)

    if isinstance(b, XGrammar):
        batcher = b.xgr.BatchGrammarMatcher(max_threads=threads)

        def par() -> None:
            batcher.batch_fill_next_token_bitmask(matchers, bitmask)

        par_name = "BatchGrammarMatcher.batch_fill_next_token_bitmask"
    else:
        assert isinstance(b, LLGuidance)
        executor = b.llg.LLExecutor(num_threads=threads)
        pairs = [(m, i) for i, m in enumerate(matchers)]
        llg_torch = b.llg_torch

        def par() -> None:
            llg_torch.fill_next_token_bitmask_par(executor, pairs, bitmask)

        par_name = "llguidance.torch.fill_next_token_bitmask_par(LLExecutor)"
    t0 = time.perf_counter_ns()
    seq()
    first = _us(time.perf_counter_ns() - t0)
    return {
        "backend": b.name,
        "rows": rows,
        "threads": threads,
        "first_fill_us": first,
        "sequential_us": time_call(seq, 20),
        "parallel_us": time_call(par, 20),
        "parallel_call": par_name,
    }


def special_token_probe(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> list[dict]:
    """Which special added tokens (ids) each way of building a matcher allows inside a free JSON
    string, and whether EOS is allowed once the value is complete."""
    import llguidance
    import llguidance.torch as llg_torch
    import transformers
    import xgrammar as xgr

    specials = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string", "maxLength": 40}},
        "required": ["note"],
    }
    prefix = tokenizer.encode('{"note":"', add_special_tokens=False).ids
    rest = tokenizer.encode('x"}', add_special_tokens=False).ids
    words = (vocab_size + 31) // 32
    out = []

    def check(
        name: str, fill: Callable[[torch.Tensor], None], accept: Callable[[int], Any]
    ) -> None:
        for t in prefix:
            accept(t)
        bm = torch.zeros((1, words), dtype=torch.int32)
        fill(bm)
        inside = [i for i in specials if allowed(bm, 0, i)]
        for t in rest:
            accept(t)
        fill(bm)
        at_end = [i for i in range(vocab_size) if allowed(bm, 0, i)]
        out.append(
            {
                "how": name,
                "special_ids_allowed_in_string": inside,
                "allowed_after_value": at_end[:10],
            }
        )

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    infos = {
        "xgrammar TokenizerInfo.from_huggingface": xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(eos_ids)
        ),
        "xgrammar TokenizerInfo, special tokens blanked": xgr_tokenizer_info(
            tokenizer, vocab_size, eos_ids
        ),
    }
    for name, info in infos.items():
        compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        xm = xgr.GrammarMatcher(compiled)

        def xfill(bm: torch.Tensor, xm: Any = xm) -> None:
            xm.fill_next_token_bitmask(bm, 0)

        check(name, xfill, xm.accept_token)
    tok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides={"whitespace_flexible": False}
    )
    lm = llguidance.LLMatcher(tok, grammar, log_level=0)
    check(
        "llguidance LLTokenizer(tokenizer.json)",
        lambda bm: llg_torch.fill_next_token_bitmask(lm, bm, 0),
        lm.consume_token,
    )
    return out


def import_times() -> dict[str, float]:
    """Seconds each library's import adds after torch's, in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import time; import torch; t=time.perf_counter(); import {m}; print(time.perf_counter()-t)"
    )
    out = {}
    for mod in ("xgrammar", "llguidance", "llguidance.torch"):
        r = subprocess.run(
            [sys.executable, "-c", code.format(m=mod)], capture_output=True, text=True, check=True
        )
        out[mod] = float(r.stdout.strip().splitlines()[-1])
    return out


# -- applying the mask ----------------------------------------------------------------------------


def unpack_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain torch: unpack the bits, masked_fill (the reference, no library)."""
    rows, vocab = logits.shape
    bits = torch.arange(32, dtype=torch.int32)
    keep = ((bitmask.unsqueeze(-1) >> bits) & 1).reshape(rows, -1)[:, :vocab].bool()
    logits.masked_fill_(~keep, float("-inf"))


def time_call(fn: Callable[[], None], iters: int, loops: int = 5) -> float:
    """The least over `loops` of the mean µs per call of `iters` calls (wall clock)."""
    per = []
    for _ in range(loops):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        per.append(_us(time.perf_counter_ns() - t0) / iters)
    return min(per)


def mask_apply(
    backends: dict[str, Backend], vocab_size: int, torch_compile: bool
) -> list[dict[str, Any]]:
    """Each helper on [rows, vocab] float32 logits, for a sparse mask (after `{"`: a key's
    first tokens only) and a dense one (inside a free string: nearly everything)."""
    import numpy as np

    rows_out: list[dict[str, Any]] = []
    b = next(iter(backends.values()))
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string", "maxLength": 40}},
        "required": ["note"],
    }
    m = b.matcher(b.compile("json", schema))
    words = (vocab_size + 31) // 32
    sparse = torch.zeros((1, words), dtype=torch.int32)
    b.fill(m, sparse, 0)
    for ch in '{"note":"':
        for t in _TOKENIZER.encode(ch, add_special_tokens=False).ids:
            b.accept(m, t)
    dense = torch.zeros((1, words), dtype=torch.int32)
    b.fill(m, dense, 0)

    def popcount(mask: torch.Tensor) -> int:
        a = mask.numpy().view(np.uint8)
        return int(np.unpackbits(a, bitorder="little")[:vocab_size].sum())

    helpers: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], None]]] = [
        ("torch unpack + masked_fill (no library)", unpack_apply)
    ]
    if any(isinstance(x, XGrammar) for x in backends.values()):
        import xgrammar as xgr

        helpers.append(
            ("xgrammar.apply_token_bitmask_inplace (cpu kernel)", xgr.apply_token_bitmask_inplace)
        )
    llg_first_call_ms = None
    if "llguidance" in backends:
        import llguidance.numpy as llg_np
        import llguidance.torch as llg_torch

        def llg_numpy(logits: torch.Tensor, mask: torch.Tensor) -> None:
            llg_np.apply_token_bitmask_inplace(logits.numpy(), mask.numpy())

        helpers.append(("llguidance.numpy.apply_token_bitmask_inplace", llg_numpy))
        if torch_compile:
            lg = torch.randn(1, vocab_size)
            t0 = time.perf_counter_ns()
            llg_torch.apply_token_bitmask_inplace(lg, sparse.clone())
            llg_first_call_ms = _ms(time.perf_counter_ns() - t0)
            helpers.append(
                (
                    "llguidance.torch.apply_token_bitmask_inplace (torch.compile)",
                    llg_torch.apply_token_bitmask_inplace,
                )
            )

    for rows in (1, 16):
        for mask_name, mask1 in (("sparse", sparse), ("dense", dense)):
            mask = mask1.expand(rows, -1).contiguous()
            base = torch.randn(rows, vocab_size)
            want = base.clone()
            unpack_apply(want, mask)
            for helper, fn in helpers:
                logits = base.clone()
                fn(logits, mask)
                same = bool(torch.equal(logits, want))
                us = time_call(functools.partial(fn, logits, mask), 300)
                rows_out.append(
                    {
                        "helper": helper,
                        "rows": rows,
                        "mask": mask_name,
                        "allowed_tokens": popcount(mask1),
                        "us": us,
                        "matches_reference": same,
                    }
                )
    if llg_first_call_ms is not None:
        rows_out.append(
            {
                "helper": "llguidance.torch.apply_token_bitmask_inplace first call (compile)",
                "rows": 1,
                "mask": "sparse",
                "us": llg_first_call_ms * 1e3,
            }
        )
    return rows_out


# -- report ---------------------------------------------------------------------------------------

_TOKENIZER: Any = None


def summarize(rows: list[dict[str, Any]], backends: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for b in backends:
        for kind in ("json", "regex", "choice", "grammar", "benchmark json"):
            if kind == "benchmark json":
                sel = [r for r in rows if r["backend"] == b and r["name"] in BENCHMARK_SCHEMAS]
            else:
                sel = [r for r in rows if r["backend"] == b and r["kind"] == kind]
            ok = [r for r in sel if r.get("ok")]
            if not sel:
                continue
            walked = [r for r in ok if r.get("walk_ok")]
            out.append(
                {
                    "backend": b,
                    "kind": kind,
                    "constraints": len(sel),
                    "compile_failures": len(sel) - len(ok),
                    "walk_failures": len(ok) - len(walked),
                    "compile_ms_median": statistics.median(r["compile_ms"] for r in ok)
                    if ok
                    else None,
                    "compile_ms_max": max(r["compile_ms"] for r in ok) if ok else None,
                    "per_token_us_cold_median": statistics.median(
                        r["cold"]["per_token_us"] for r in walked
                    )
                    if walked
                    else None,
                    "per_token_us_warm_median": statistics.median(
                        r["warm"]["per_token_us"] for r in walked
                    )
                    if walked
                    else None,
                    "fill_us_warm_median": statistics.median(r["warm"]["fill_us"] for r in walked)
                    if walked
                    else None,
                    "accept_us_warm_median": statistics.median(
                        r["warm"]["accept_us"] for r in walked
                    )
                    if walked
                    else None,
                    "fork_us_median": statistics.median(r["fork_us"] for r in ok) if ok else None,
                    "walks_with_detours": sum(1 for r in walked if r["cold"]["detours"]),
                }
            )
    return out


def print_report(rep: dict[str, Any]) -> None:
    backends = rep["backends"]
    m = rep["machine"]
    print(f"\n{m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores, load {m['load_avg_1m']}")
    threads = rep["xgrammar_max_threads"]
    print(f"compiles and walks timed by {rep['clock']}; xgrammar max_threads={threads}")
    print(f"schema patterns: {rep['patterns']}")
    for b, info in rep["setup"].items():
        print(f"{b} {info['version']}: tokenizer info built in {info['setup_ms']:.0f} ms")
    by = {(r["backend"], r["kind"], r["name"]): r for r in rep["constraints"]}
    names = []
    for r in rep["constraints"]:
        if (r["kind"], r["name"]) not in names:
            names.append((r["kind"], r["name"]))

    def cell(b: str, kind: str, name: str, what: str) -> Any:
        r = by.get((b, kind, name))
        if r is None:
            return None
        if not r.get("ok"):
            return "FAIL"
        if what == "compile":
            return r["compile_ms"]
        if not r.get("walk_ok"):
            return "WALK FAIL"
        return r[what]["per_token_us"]

    headers = ["kind", "constraint", "tokens"]
    headers += [f"{b} compile ms" for b in backends]
    headers += [f"{b} µs/tok cold" for b in backends]
    headers += [f"{b} µs/tok warm" for b in backends]
    table = []
    for kind, name in names:
        tokens = next(
            (by[(b, kind, name)].get("tokens") for b in backends if (b, kind, name) in by), None
        )
        row = [kind, name, tokens]
        row += [cell(b, kind, name, "compile") for b in backends]
        row += [cell(b, kind, name, "cold") for b in backends]
        row += [cell(b, kind, name, "warm") for b in backends]
        table.append(row)
    print("\nPer constraint (compile: cold, median of reps; per token: fill bitmask + accept)\n")
    print(format_table(headers, table))

    print("\nSummary (medians over the constraints each backend compiled and walked)\n")
    keys = [
        "backend",
        "kind",
        "constraints",
        "compile_failures",
        "walk_failures",
        "compile_ms_median",
        "compile_ms_max",
        "per_token_us_cold_median",
        "per_token_us_warm_median",
        "fill_us_warm_median",
        "accept_us_warm_median",
        "fork_us_median",
        "walks_with_detours",
    ]
    print(format_table(keys, [[s[k] for k in keys] for s in rep["summary"]]))

    fails = [r for r in rep["constraints"] if not r.get("ok") or not r.get("walk_ok")]
    if fails:
        print("\nCoverage failures\n")
        for r in fails:
            why = r.get("error") or r.get("walk_error")
            print(f"  {r['backend']:14} {r['kind']:8} {r['name']:22} {why}")

    if rep.get("mask_apply"):
        print("\nApplying the bitmask to float32 logits on the CPU\n")
        keys = ["helper", "rows", "mask", "allowed_tokens", "us", "matches_reference"]
        print(format_table(keys, [[r.get(k) for k in keys] for r in rep["mask_apply"]]))

    if rep.get("probes"):
        print("\nFeature probes: compiles / valid instance accepted / invalid instance refused\n")
        feats: list[str] = []
        pb = {}
        for r in rep["probes"]:
            if r["feature"] not in feats:
                feats.append(r["feature"])
            pb[(r["backend"], r["feature"])] = r

        def mark(r: dict[str, Any] | None) -> str:
            if r is None:
                return "-"
            if not r["compiles"]:
                return "no compile"
            v = {True: "y", False: "N", None: "."}
            return f"{v[r['valid_accepted']]} {v[r['invalid_refused']]}"

        print(
            format_table(
                ["feature", *backends],
                [[f, *(mark(pb.get((b, f))) for b in backends)] for f in feats],
            )
        )
        print("  (y y: enforced; y N: compiles but does not enforce; N: refuses a valid instance)")

    if rep.get("special_tokens"):
        print(
            "\nSpecial tokens allowed inside a free JSON string; tokens allowed after the value\n"
        )
        for r in rep["special_tokens"]:
            print(
                f"  {r['how']:48} in string: {r['special_ids_allowed_in_string']}"
                f"  after value: {r['allowed_after_value']}"
            )
    if rep.get("batch_fill"):
        print("\nOne step's masks for 16 rows (benchmark schemas at varied points), µs\n")
        keys = ["backend", "rows", "threads", "first_fill_us", "sequential_us", "parallel_us"]
        print(format_table(keys, [[r[k] for k in keys] for r in rep["batch_fill"]]))
    if rep.get("import_s"):
        print("\nImport time after torch (s):", rep["import_s"])

    if rep.get("gil"):
        print("\nGIL during compile (main thread's counting rate vs alone; ~1 released, ~0 held)\n")
        keys = ["backend", "compile_s", "main_thread_rate_vs_alone"]
        print(format_table(keys, [[r[k] for k in keys] for r in rep["gil"]]))


def main(argv: Sequence[str] | None = None) -> int:
    global _TOKENIZER
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--reps", type=int, default=3, help="cold compiles per constraint")
    p.add_argument("--xgr-threads", type=int, default=1, help="xgrammar compiler max_threads")
    p.add_argument("--quick", action="store_true", help="benchmark schemas only, 1 rep")
    p.add_argument("--no-probes", action="store_true")
    p.add_argument("--no-torch-compile", action="store_true", help="skip llguidance.torch apply")
    p.add_argument(
        "--as-is",
        action="store_true",
        help="schemas' unanchored patterns as they are (default: anchored, ^(...)$)",
    )
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="compile/walk timer")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    global clock, ANCHOR
    ANCHOR = not a.as_is
    clock = time.thread_time_ns if a.clock == "cpu" else time.perf_counter_ns

    from control_plane.tokenizer import load_tokenizer
    from gpu_worker.models.config import ModelConfig

    model = a.model or model_dir("smollm2")
    tokenizer = load_tokenizer(model).tokenizer
    _TOKENIZER = tokenizer
    mc = ModelConfig.from_dir(model)
    vocab_size, eos_ids = mc.vocab_size, list(mc.eos_token_ids)
    names = [n for n in a.backends.split(",") if n]
    reps = 1 if a.quick else a.reps

    backends: dict[str, Backend] = {}
    for n in names:
        b = make_backend(n, tokenizer, vocab_size, eos_ids)
        if isinstance(b, XGrammar):
            b.threads = a.xgr_threads
        backends[n] = b
    setup = {n: {"version": b.version, "setup_ms": b.setup_ms} for n, b in backends.items()}

    rows = []
    todo = constraints(a.quick)
    for kind, name, spec, text in todo:
        for b in backends.values():
            rows.append(measure_constraint(b, kind, name, spec, text, tokenizer, reps))
        print(".", end="", flush=True)
    print()

    twenty = {}
    for b in backends.values():
        r = measure_constraint(
            b,
            "json",
            "customer_record_20",
            anchored(TWENTY_PROPERTY_SCHEMA) if ANCHOR else TWENTY_PROPERTY_SCHEMA,
            json.dumps(SCHEMA_EXAMPLES["customer_record_20"], separators=(",", ":")),
            tokenizer,
            max(reps, 5),
        )
        twenty[b.name] = (
            {k: r.get(k) for k in ("ok", "compile_ms", "compile_ms_all", "error", "tokens")}
            | {"per_token_us_cold": r.get("cold", {}).get("per_token_us")}
            | {"per_token_us_warm": r.get("warm", {}).get("per_token_us")}
        )

    probes = []
    if not a.no_probes:
        for b in backends.values():
            probes += feature_probes(b, tokenizer)
    twenty_schema = anchored(TWENTY_PROPERTY_SCHEMA) if ANCHOR else TWENTY_PROPERTY_SCHEMA
    gil = [gil_probe(b, "json", twenty_schema) for b in backends.values()]
    batch = [batch_fill(b, tokenizer) for b in backends.values()]
    specials = special_token_probe(tokenizer, vocab_size, eos_ids)
    imports = import_times()
    apply_rows = mask_apply(backends, vocab_size, not a.no_torch_compile)

    rep = {
        "benchmark": "grammar_backends",
        "mode": "quick" if a.quick else "full",
        "model": str(model),
        "vocab_size": vocab_size,
        "eos_token_ids": eos_ids,
        "reps": reps,
        "xgrammar_max_threads": a.xgr_threads,
        "clock": "thread CPU time" if a.clock == "cpu" else "wall",
        "patterns": "as they are" if a.as_is else "anchored ^(...)$",
        "machine": machine(),
        "backends": names,
        "setup": setup,
        "summary": summarize(rows, names),
        "twenty_property_schema": twenty,
        "constraints": rows,
        "mask_apply": apply_rows,
        "probes": probes,
        "gil": gil,
        "special_tokens": specials,
        "batch_fill": batch,
        "import_s": imports,
    }
    print_report(rep)
    print("\n20-property schema:", json.dumps(twenty, indent=1))
    out = a.out or RESULTS_DIR / "grammar_backends.json"
    write_json(out, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

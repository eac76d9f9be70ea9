"""What a constraint may ask of the grammar library before it reaches it, and the stack it
compiles on.

The library compiles a grammar by recursing through it in native code: its depth on the
stack follows the longest chain of rules that refer one to the next (a `$ref` to a `$ref`, a
subschema inside a subschema, `r0: r1`, `r1: r2`, ...). Measured with llguidance 1.9.1 on an
8 MiB thread stack, the compiler overflowed (SIGSEGV, taking its process down) at

    json_schema  $defs chain of bare $refs          2,500 deep  (1 unit a link)
                 $defs chain through properties       920 deep  (2 units a link)
                 ... through anyOf / items / allOf  1,050-1,350 (2 units a link)
    grammar      rule chain r_i: r_{i+1}            2,700 deep  (1 unit a rule)
                 terminal chain T_i: T_{i+1}        3,500 deep

so about 1,840 units of this module's measure fill 8 MiB (~4.5 KiB a unit). MAX_DEPTH
refuses anything past 512 units (3.6x short of 8 MiB), and compilation runs on threads of
STACK_BYTES (64 MiB: ~28x short). Nesting inside one rule or one regex is bounded by the
library itself ("too deeply nested", "invalid regex"). The measure:

* a JSON schema is a graph of subschemas: each nested subschema and each `$ref` target is
  an edge; its depth is the longest path from any subschema, counted in subschemas, where a
  reference back to a subschema on the path (recursion the library resolves by name) ends it;
* a Lark or GBNF grammar is a graph of its rules and terminals, each name in a definition's
  body an edge; a `%json {...}` inside one is measured as a schema of its own.

A constraint past a bound is refused with InvalidRequestError naming the bound, in both planes
(`grammar.grammar_text` checks it), so a worker never compiles what the control plane would
not.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

from pagedserve.sampling_params import InvalidRequestError

MAX_DEPTH = 512
MAX_NODES = 10_000  # subschemas of a JSON schema, rules and terminals of a grammar
MAX_SPEC_BYTES = 1 << 20
STACK_BYTES = 64 << 20

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

_SUBSCHEMA_KEYS = ("items", "additionalItems", "contains", "not", "if", "then", "else",
                   "propertyNames", "unevaluatedItems", "unevaluatedProperties",
                   "additionalProperties")  # fmt: skip
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas", "dependencies")  # fmt: skip


class TooDeep(Exception):
    pass


class TooMany(Exception):
    pass


def longest_chain(roots: Iterable[K], children: Callable[[K], Iterable[K]]) -> int:
    """The longest path, in nodes, from any of `roots` down the graph, an edge back to a node
    on the path ending it. Iterative (a schema may be far deeper than Python recurses).
    Raises TooDeep once a path passes MAX_DEPTH, TooMany once MAX_NODES nodes are seen."""
    depth: dict[K, int] = {}
    for root in roots:
        if root in depth:
            continue
        best: dict[K, int] = {root: 0}  # per node on the path: its deepest child so far
        path: list[tuple[K, Iterable[K]]] = [(root, iter(children(root)))]
        while path:
            node, pending = path[-1]
            for child in pending:  # type: ignore[attr-defined]
                if child in depth:
                    best[node] = max(best[node], depth[child])
                elif child not in best:
                    if len(path) >= MAX_DEPTH:
                        raise TooDeep
                    if len(depth) + len(best) >= MAX_NODES:
                        raise TooMany
                    best[child] = 0
                    path.append((child, iter(children(child))))
                    break
            else:
                path.pop()
                depth[node] = best.pop(node) + 1
                if path:
                    parent = path[-1][0]
                    best[parent] = max(best[parent], depth[node])
    return max(depth.values(), default=0)


def schema_depth(schema: Any) -> int:
    """A JSON schema's depth in subschemas, `$ref`s followed (see the module's docstring)."""
    nodes: dict[int, Any] = {id(schema): schema}

    def resolve(ref: str) -> Any:
        if ref == "#":
            return schema
        if not ref.startswith("#/"):
            return None  # anchors and remote references: the library refuses or names them
        target = schema
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None
        return target

    def children(key: int) -> list[int]:
        node = nodes[key]
        if not isinstance(node, dict):
            return []
        found: list[Any] = []
        for name in _SUBSCHEMA_KEYS:
            if isinstance(node.get(name), dict):
                found.append(node[name])
        for name in _SUBSCHEMA_LISTS:
            if isinstance(node.get(name), list):
                found.extend(s for s in node[name] if isinstance(s, dict))
        for name in _SUBSCHEMA_MAPS:
            if isinstance(node.get(name), dict):
                found.extend(s for s in node[name].values() if isinstance(s, dict))
        if isinstance(node.get("$ref"), str):
            target = resolve(node["$ref"])
            if isinstance(target, dict):
                found.append(target)
        for s in found:
            nodes[id(s)] = s
        return [id(s) for s in found]

    return longest_chain([id(schema)], children)


# A grammar's text, piece by piece: literals and comments are skipped (a name inside one is no
# reference), `%json` and `%llguidance` take a JSON value after them.
_PIECE = re.compile(
    r"""(?P<skip>"(?:[^"\\\n]|\\.)*"i?|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*
           |\[(?:[^\]\\\n]|\\.)*\]|//[^\n]*|\#[^\n]*)
      |(?P<json>%(?:json|llguidance)\b)
      |(?P<name>[A-Za-z_][A-Za-z0-9_\-]*)
      |(?P<nl>\n)
      |(?P<other>[^\sA-Za-z_"/\[#%]+|\s|.)""",
    re.X,
)
_DEFINITION = re.compile(r"\s*[?!]?([A-Za-z_][A-Za-z0-9_\-]*)(?:\.-?\d+)?\s*(?:::=|:)")


def grammar_depth(text: str) -> int:
    """A Lark or GBNF grammar's longest chain of definitions naming one another; every schema
    inside it (`%json`) is bounded as a schema."""
    skeleton: list[str] = []  # the text with literals, comments and JSON blanked
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(text):
        m = _PIECE.match(text, pos)
        assert m is not None  # the last alternative takes any character
        if m.lastgroup == "json":
            start = m.end()
            while start < len(text) and text[start] in " \t\r\n":
                start += 1
            try:
                value, end = decoder.raw_decode(text, start)
            except ValueError:
                end = m.end()  # the library will say what is wrong with it
            else:
                if text[m.start() + 1 : m.end()] == "json":
                    bound_schema(value, "grammar")
            skeleton.append("\n" * text.count("\n", m.start(), end))
            pos = end
            continue
        skeleton.append(" " if m.lastgroup == "skip" else m.group())
        pos = m.end()
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in "".join(skeleton).split("\n"):
        d = _DEFINITION.match(line)
        if d is not None:
            current = bodies.setdefault(d.group(1), [])
            line = line[d.end() :]
        elif line.lstrip().startswith("%"):
            current = None
            continue
        if current is not None:
            current.extend(re.findall(r"[A-Za-z_][A-Za-z0-9_\-]*", line))
    refs = {name: [r for r in body if r in bodies] for name, body in bodies.items()}
    return longest_chain(refs, lambda name: refs[name])


def bound_schema(schema: Any, field: str) -> None:
    try:
        schema_depth(schema)
    except TooDeep:
        raise InvalidRequestError(
            f"{field}: its subschemas and $refs nest more than {MAX_DEPTH} deep, the most "
            "this server compiles"
        ) from None
    except TooMany:
        raise InvalidRequestError(
            f"{field}: it has more than {MAX_NODES} subschemas, the most compiled"
        ) from None


def bound(kind: str, field: str, spec: str) -> None:
    """InvalidRequestError naming the bound a constraint passes (MAX_SPEC_BYTES, MAX_DEPTH,
    MAX_NODES); nothing for one within them."""
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(
            f"{field} is {size} bytes; at most {MAX_SPEC_BYTES} bytes are compiled"
        )
    if kind == "json_schema":
        bound_schema(json.loads(spec), field)
    elif kind == "grammar":
        try:
            grammar_depth(spec)
        except TooDeep:
            raise InvalidRequestError(
                f"{field}: its rules refer one to the next more than {MAX_DEPTH} deep, the "
                "most this server compiles"
            ) from None
        except TooMany:
            raise InvalidRequestError(
                f"{field}: it defines more than {MAX_NODES} rules and terminals, the most compiled"
            ) from None


_stack_lock = threading.Lock()


def on_deep_stack(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a thread of its own with a STACK_BYTES stack (reserved, not
    committed), the caller waiting; its exception is re-raised here."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn(*args, **kwargs)))
        except BaseException as exc:  # handed to the caller
            out.append((False, exc))

    with _stack_lock:  # the size is process-wide: set it for this thread's creation only
        previous = threading.stack_size(STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]

"""Structured output: a request's constraint (`StructuredOutput`) compiled into a grammar over
the model's vocabulary, and a matcher per request that says, before each token, which tokens
keep the text inside it (xgrammar: a compiled grammar precomputes the mask of most tokens per
grammar position, so a step's mask costs microseconds, and compilation is cached).

Both planes compile: the control plane at admission, so that a constraint that does not
compile is refused (INVALID_ARGUMENT) before it reaches a worker, and the worker when a
constrained request first arrives (the same constraint compiles to the same grammar; each
process caches by constraint). JSON schemas compile with compact separators and no free
whitespace, so a model cannot wander into endless blanks. The stop tokens are the model's EOS
ids: the mask allows them exactly where the text is complete, so a constrained output ends
with EOS there (or at max_tokens).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pagedserve.sampling_params import InvalidRequestError, StructuredOutput

# Compiled grammars (and refusals) kept per process.
CACHE_SIZE = 512
# Threads a compilation, and a step's mask filling, may use.
GRAMMAR_THREADS = 2
_FIELD = {
    "json_schema": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def vocab_tokenizer(model_path: str | Path) -> Tokenizer:
    """The model's tokenizer as the control plane loads it: the GGUF's vocabulary, or
    tokenizer.json."""
    from pagedserve.gguf import find_gguf, open_gguf

    gguf_file = find_gguf(model_path)
    if gguf_file is not None:
        tok: Tokenizer = open_gguf(gguf_file).tokenizer()
        return tok
    return Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))


def _choice_grammar(options: list[str]) -> str:
    # JSON string escapes are EBNF string escapes for these characters.
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def check(constraint: StructuredOutput) -> None:
    """Parses a constraint into a grammar, without the vocabulary (about a millisecond): a
    schema, regex or grammar that cannot compile fails here. InvalidRequestError naming the
    field and the reason."""
    import xgrammar as xgr

    try:
        if constraint.kind == "json_schema":
            xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False, strict_mode=True)
        elif constraint.kind == "regex":
            xgr.Grammar.from_regex(constraint.spec)
        elif constraint.kind == "choice":
            xgr.Grammar.from_ebnf(_choice_grammar(constraint.choice_list))
        elif constraint.kind == "grammar":
            xgr.Grammar.from_ebnf(constraint.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _refusal(constraint, exc) from None


def _refusal(constraint: StructuredOutput, exc: Exception) -> InvalidRequestError:
    # xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: ".
    text = re.sub(
        r"^\[[0-9:]+\] \S+:[0-9]+: ",
        "",
        str(exc).strip().splitlines()[0] if str(exc).strip() else "",
    )
    return InvalidRequestError(
        f"{_FIELD[constraint.kind]} does not compile: {text or type(exc).__name__}"
    )


class GrammarCompiler:
    """Compiles constraints for one vocabulary; thread-safe; caches by constraint (a refusal
    too, so a bad constraint sent again costs nothing)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        import transformers
        import xgrammar as xgr

        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=GRAMMAR_THREADS, cache_enabled=False
        )
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._compiling: dict[StructuredOutput, Future[Any]] = {}
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar; InvalidRequestError naming the field and the reason. A
        constraint being compiled by another thread is waited for, not compiled twice."""
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
                except (RuntimeError, ValueError, TypeError) as exc:
                    hit = _refusal(constraint, exc)
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

    def _compile(self, c: StructuredOutput) -> Any:
        compiler = self._compiler
        if c.kind == "json_schema":
            return compiler.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
        if c.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if c.kind == "regex":
            return compiler.compile_regex(c.spec)
        if c.kind == "choice":
            return compiler.compile_grammar(_choice_grammar(c.choice_list))
        return compiler.compile_grammar(c.spec)

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        return Matcher(self._xgr.GrammarMatcher(self.compile(constraint)))


class Matcher:
    """Where one request's output stands in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advances past a token; False (unchanged) if the grammar does not allow it."""
        return bool(self._m.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return bool(self._m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


_batch: Any = None


def mask_logits(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Matcher]) -> None:
    """Sets to -inf, in place, the logits of row rows[i] that matchers[i] does not allow next
    (rows of terminated matchers are left alone). The masks are filled on xgrammar's threads
    and applied by its CPU kernel (float32 logits), or by torch."""
    global _batch
    import xgrammar as xgr

    live = [(r, m) for r, m in zip(rows, matchers, strict=True) if not m.terminated]
    if not live:
        return
    if _batch is None:
        _batch = xgr.BatchGrammarMatcher(max_threads=GRAMMAR_THREADS)
    num_rows, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab)
    indices = [r for r, _ in live]
    _batch.batch_fill_next_token_bitmask([m._m for _, m in live], bitmask, indices=indices)
    if logits.dtype == torch.float32 and logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
        return
    bits = torch.arange(32, dtype=torch.int32)
    index = torch.tensor(indices, dtype=torch.long)
    allowed = (bitmask[index].unsqueeze(-1) >> bits) & 1  # [L, words, 32]: token 32w + i
    allowed = allowed.reshape(len(indices), -1)[:, :vocab].bool().to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

"""Checking structured-output constraints in child processes, so that native code failing on
one (a stack overflow, an abort) costs that request and nothing else.

Each child (`python -m control_plane.grammar_check`) reads one JSON line per constraint on
stdin, `{"kind": ..., "spec": ...}`, compiles it without the vocabulary
(`pagedserve.grammar.check`, inside `grammar_bounds`' limits) and answers one JSON line,
`{"error": null | "why"}`. The control plane keeps `processes` children, one constraint in
each at a time:

* a child killed by a signal while it holds a constraint (a native crash) refuses that
  constraint (cached: sent again, it is refused at once) and is started again for the next;
  one that ends by itself (it cannot start) is no verdict: GrammarCheckUnavailable;
* a constraint still compiling after the timeout is refused as too slow (not cached: a busy
  moment is no verdict) and its child is killed, which also ends the compilation's CPU use.

A child ends when its stdin closes, so none outlives the control plane.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence

from pagedserve.log import get_logger
from pagedserve.sampling_params import InvalidRequestError, StructuredOutput

log = get_logger(__name__)

CHILD_ARGV = (sys.executable, "-m", "control_plane.grammar_check")
# A reply is one short JSON line; a constraint's line may be long (a schema of up to
# grammar_bounds.MAX_SPEC_BYTES, escaped).
_READ_LIMIT = 1 << 20


class GrammarTimeout(Exception):
    """The constraint did not compile within the timeout."""


class GrammarCheckUnavailable(RuntimeError):
    """No check process could be started to take the constraint (it is no verdict on it)."""


class _Child:
    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = argv
        self.proc: asyncio.subprocess.Process | None = None

    async def ask(self, line: bytes, timeout_s: float) -> bytes:
        """The child's reply line; b"" where the child exited while it held the line. A child
        found gone before the line reached it (it ended with an earlier constraint) is started
        again for this one; GrammarCheckUnavailable where that one is gone at once too. A
        caller cancelled meanwhile kills the child: its late reply must not answer the next
        constraint."""
        for _ in range(2):
            proc = self.proc
            if proc is None or proc.returncode is not None:
                proc = self.proc = await asyncio.create_subprocess_exec(
                    *self.argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    limit=_READ_LIMIT,
                )
            assert proc.stdin is not None and proc.stdout is not None
            try:
                if proc.stdin.is_closing():
                    raise BrokenPipeError
                proc.stdin.write(line)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError, RuntimeError):  # closed transport
                self.kill()
                continue
            except BaseException:
                self.kill()
                raise
            try:
                return await asyncio.wait_for(proc.stdout.readline(), timeout_s)
            except TimeoutError:
                self.kill()
                raise GrammarTimeout from None
            except BaseException:
                self.kill()
                raise
        raise GrammarCheckUnavailable("the grammar check process ends as it starts")

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        self.proc = None

    async def exit_code(self) -> int | None:
        if self.proc is None:
            return None
        try:
            return await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            self.kill()
            return None


class GrammarChecker:
    """check(constraint): None, or InvalidRequestError naming the field and why it cannot
    compile; GrammarTimeout past `timeout_s`. At most `processes` checks run at once; the
    others wait for a child."""

    def __init__(self, processes: int, timeout_s: float, argv: Sequence[str] = CHILD_ARGV) -> None:
        self.timeout_s = timeout_s
        self._children = [_Child(argv) for _ in range(processes)]
        self._idle: asyncio.Queue[_Child] | None = None

    async def check(self, constraint: StructuredOutput) -> InvalidRequestError | None:
        if self._idle is None:  # made on the event loop that uses it
            self._idle = asyncio.Queue()
            for child in self._children:
                self._idle.put_nowait(child)
        line = json.dumps({"kind": constraint.kind, "spec": constraint.spec}) + "\n"
        child = await self._idle.get()
        try:
            reply = await child.ask(line.encode(), self.timeout_s)
            if not reply:
                code = await child.exit_code()
                child.kill()
                if code is None or code >= 0:  # it ended by itself: no verdict on the constraint
                    raise GrammarCheckUnavailable(
                        f"the grammar check process ended with code {code}"
                    )
                log.error("grammar_check_crashed", kind=constraint.kind, exit_code=code)
                return InvalidRequestError(
                    f"{constraint.kind} could not be compiled: the grammar library failed on it "
                    f"(its check process exited with code {code})"
                )
            error = json.loads(reply)["error"]
            return None if error is None else InvalidRequestError(error)
        finally:
            self._idle.put_nowait(child)

    async def close(self) -> None:
        """Ends the children and waits for them (their pipes close on this event loop)."""
        for child in self._children:
            proc = child.proc
            child.kill()
            if proc is not None:
                await proc.wait()


def main() -> None:
    from pagedserve import grammar

    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            grammar.check(StructuredOutput(request["kind"], request["spec"]))
            error = None
        except InvalidRequestError as exc:
            error = str(exc)
        except Exception as exc:  # the library's own error: a refusal, not this process's end
            error = f"{request['kind']} does not compile: {type(exc).__name__}: {exc}"
        sys.stdout.write(json.dumps({"error": error}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""The gateway's per-request inbox: one wake-up takes what every call delivered, a slow client's
backlog is merged per completion past MERGE_AFTER, and a client that takes nothing for the stall
timeout has its calls aborted once, with the stall after what was waiting."""

from __future__ import annotations

import asyncio

import pytest

from gateway.upstream import MERGE_AFTER, Inbox, Stalled, unavailable
from protos.v1 import control_plane_pb2 as pb


def message(index: int, token: int, last: bool = False) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        token_ids=[token], text=f"<{token}>", index=index, completion_tokens=token, last=last
    )


def test_one_take_holds_every_call_in_order() -> None:
    async def run() -> None:
        seen: list[tuple[int, int]] = []
        inbox = Inbox(60.0, lambda slot, msg: seen.append((slot, msg.token_ids[-1])))
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing yet
        inbox.put(0, message(0, 1))
        inbox.put(1, message(0, 2))
        inbox.put(0, message(1, 3))
        items = await waiting
        assert [(slot, m.token_ids[0]) for slot, m in items] == [(0, 1), (1, 2), (0, 3)]
        assert seen == [(0, 1), (1, 2), (0, 3)]  # every message timed as it came
        error = unavailable("gone")
        inbox.put(1, error)
        assert await inbox.take() == [(1, error)]

    asyncio.run(run())


def test_a_backlog_is_merged_per_completion_past_the_bound() -> None:
    async def run() -> None:
        inbox = Inbox(60.0, lambda slot, msg: None)
        for t in range(MERGE_AFTER):
            inbox.put(t % 2, message(0, t))
        for t in range(MERGE_AFTER, MERGE_AFTER + 100):
            inbox.put(t % 2, message(t % 3, t, last=t == MERGE_AFTER + 99))
        items = await inbox.take()
        # Past the bound a completion gets at most one new message, merged from the rest.
        assert len(items) <= MERGE_AFTER + 6
        tokens = {
            (slot, m.index): [t for s, mm in items if (s, mm.index) == (slot, m.index)
                              for t in mm.token_ids]
            for slot, m in items
        }  # fmt: skip
        every = sorted(t for ts in tokens.values() for t in ts)
        assert every == list(range(MERGE_AFTER + 100))  # nothing lost, nothing twice
        for (slot, _), ts in tokens.items():
            assert ts == sorted(ts)  # each completion's tokens in order
            assert all(t % 2 == slot for t in ts)
        merged = [m for _, m in items if len(m.token_ids) > 1]
        assert merged and all(m.text == "".join(f"<{t}>" for t in m.token_ids) for m in merged)
        assert sum(m.last for _, m in items) == 1
        last = next(m for _, m in items if m.last)
        assert last.completion_tokens == MERGE_AFTER + 99  # the newest count wins

    asyncio.run(run())


@pytest.mark.parametrize("reads", [False, True])
def test_a_client_that_takes_nothing_stalls_once(reads: bool) -> None:
    async def run() -> None:
        stalls: list[int] = []
        inbox = Inbox(0.2, lambda slot, msg: None)
        inbox.on_stall = lambda: stalls.append(1)
        taken: list[object] = []
        for t in range(12):
            inbox.put(0, message(0, t))
            if reads:
                taken += await inbox.take()
            await asyncio.sleep(0.05)
        if reads:
            assert not stalls and not inbox.stalled  # a client that keeps taking never stalls
            return
        assert stalls == [1] and inbox.stalled
        items = await inbox.take()
        assert isinstance(items[-1][1], Stalled)  # after everything that waited
        assert [m.token_ids[0] for _, m in items[:-1]] == list(range(len(items) - 1))

    asyncio.run(run())

"""Both prefix-index backends against the same contract; Redis is a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from control_plane.prefix_index import (
    MemoryPrefixIndex,
    PrefixIndex,
    PrefixIndexLost,
    PrefixIndexUnavailable,
    RedisPrefixIndex,
    WorkerRef,
)
from tests.redis_proc import RedisServer

H = [bytes([i]) * 16 for i in range(6)]
W0, W1 = WorkerRef("w0", 1), WorkerRef("w1", 7)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "redis"])
def make_index(request: pytest.FixtureRequest, redis_server: RedisServer):  # type: ignore[no-untyped-def]
    made: list[PrefixIndex] = []

    def make(model: str = "m") -> PrefixIndex:
        if request.param == "memory":
            index: PrefixIndex = MemoryPrefixIndex()
        else:
            redis_server.client().flushall()
            index = RedisPrefixIndex(redis_server.url, model)
        made.append(index)
        return index

    return make


def test_longest_prefix_per_worker(make_index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        index = make_index()
        await index.update(W0, H[:4], ())
        await index.update(W1, [H[0], H[1], H[3]], ())
        assert await index.lookup(H[:5], [W0, W1]) == {"w0": 4, "w1": 2}
        await index.update(W0, (), [H[1]])
        assert await index.lookup(H[:5], [W0, W1]) == {"w0": 1, "w1": 2}
        # A restarted worker (new epoch) holds nothing until it publishes again.
        assert await index.lookup(H[:5], [WorkerRef("w1", 8)]) == {"w1": 0}
        await index.replace_worker(WorkerRef("w1", 8), [H[0]])
        assert await index.lookup(H[:5], [WorkerRef("w1", 8)]) == {"w1": 1}
        assert await index.lookup(H[:5], [W1]) == {"w1": 0}  # old-epoch entries are gone
        await index.close()

    asyncio.run(go())


def test_redis_outage_raises_unavailable_then_recovers(redis_server: RedisServer) -> None:
    async def go() -> None:
        index = RedisPrefixIndex(redis_server.url, "outage")
        await index.update(W0, H[:2], ())
        redis_server.stop()
        with pytest.raises(PrefixIndexUnavailable):
            await index.lookup(H[:2], [W0])
        with pytest.raises(PrefixIndexUnavailable):
            await index.update(W0, H[2:3], ())
        redis_server.start()
        # The restarted Redis is empty: the index says so until it is rebuilt.
        with pytest.raises(PrefixIndexLost):
            await index.lookup(H[:2], [W0])
        await index.reconnect()
        await index.replace_worker(W0, H[:3])
        assert await index.lookup(H[:4], [W0]) == {"w0": 3}
        await index.close()

    asyncio.run(go())


@pytest.mark.parametrize("loss", ["restart", "flushall"])
def test_every_index_notices_a_redis_that_lost_its_data(
    redis_server: RedisServer, loss: str
) -> None:
    """Redis restarted between two calls (no call saw it down) or flushed: its client
    reconnects without an error once a dead pooled connection has failed one call, yet every
    index sharing it (one per control plane) raises PrefixIndexLost on each later call until
    it has reconnected and rebuilt its workers' entries."""

    async def go() -> None:
        a, b = (
            RedisPrefixIndex(redis_server.url, "lost"),
            RedisPrefixIndex(redis_server.url, "lost"),
        )
        await a.update(W0, H[:3], ())
        await b.update(W1, H[:2], ())
        assert await a.lookup(H[:3], [W0, W1]) == {"w0": 3, "w1": 2}
        if loss == "restart":
            redis_server.stop()
            redis_server.start()
        else:
            redis_server.client().flushall()
        with pytest.raises(PrefixIndexUnavailable):  # a dead connection, or the loss itself
            await a.update(W0, H[3:4], ())
        with pytest.raises(PrefixIndexLost):  # and so on until reconnect()
            await a.replace_worker(W0, H[:4])
        await a.reconnect()
        await a.replace_worker(W0, H[:4])
        assert await a.lookup(H[:4], [W0]) == {"w0": 4}  # a is whole again ...
        with pytest.raises(PrefixIndexUnavailable):  # ... and b's own loss still shows,
            await b.check()  # also to the check made while nothing else asks the index
        with pytest.raises(PrefixIndexLost):
            await b.lookup(H[:2], [W1])
        with pytest.raises(PrefixIndexLost):
            await b.update(W1, H[2:3], ())
        await b.reconnect()
        await b.replace_worker(W1, H[:2])
        assert await b.lookup(H[:4], [W0, W1]) == {"w0": 4, "w1": 2}
        await a.check()
        await b.check()
        await a.close()
        await b.close()

    asyncio.run(go())


@pytest.mark.serial  # a wall-clock bound: each lookup within its deadline
def test_lookups_right_after_an_outage_meet_their_deadline(redis_server: RedisServer) -> None:
    """Every pooled connection died with the server: reconnect() drops them all, so no call
    after the outage fails on a dead connection (kept, reconnect()'s own first call fails).
    Lookups here have 0.5 s, not the service's 50 ms, which a lookup overran on a busy machine
    with no dead connection in the pool."""

    async def go() -> None:
        index = RedisPrefixIndex(redis_server.url, "pool", timeout_s=0.5)
        await index.update(W0, H[:3], ())
        # Concurrent lookups leave several connections in the pool.
        await asyncio.gather(*(index.lookup(H[:3], [W0]) for _ in range(8)))
        redis_server.stop()
        redis_server.start()
        await index.reconnect()
        await index.replace_worker(W0, H[:3])
        for _ in range(8):  # one after another: each may take a different pooled connection
            assert await index.lookup(H[:3], [W0]) == {"w0": 3}
        await index.close()

    asyncio.run(go())


def test_a_batch_of_events_larger_than_one_update_call(make_index) -> None:  # type: ignore[no-untyped-def]
    """Removals come before stores (a block evicted and cached again in one batch stays
    recorded), also when the batch spans several of Redis's update calls, and every stored
    entry carries the TTL."""
    from control_plane.prefix_index import UPDATE_BATCH

    async def go() -> None:
        index = make_index()
        many = [i.to_bytes(16, "big") for i in range(UPDATE_BATCH + 300)]
        await index.update(W0, many, ())
        removed = many[: UPDATE_BATCH + 100]  # past the first call's keys
        again = many[UPDATE_BATCH - 10 : UPDATE_BATCH + 10]  # evicted and cached again
        await index.update(W0, again, removed)
        assert await index.lookup(many[:1], [W0]) == {"w0": 0}
        assert await index.lookup(again, [W0]) == {"w0": len(again)}
        assert await index.lookup(many[UPDATE_BATCH + 10 :], [W0]) == {"w0": 0}
        assert await index.lookup(many[UPDATE_BATCH + 100 :], [W0]) == {"w0": 200}
        if isinstance(index, RedisPrefixIndex):
            client = index._redis
            ttls = {await client.ttl(index._key(h)) for h in again + many[-5:]}
            assert all(0 < t <= 24 * 3600 for t in ttls), ttls
        await index.close()

    asyncio.run(go())

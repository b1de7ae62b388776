"""Batched output streams without Ray: a rank's pumps and outboxes (`imm.rank_streams`), the ingress's
channels (`coordinator.rank_channels`) and the deltas-only wire (`OutputDelta`, `OutputAccumulator`)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from coordinator.rank_channels import ChannelClosed, RankChannel
from elasticmoe.errors import InvalidRequestError
from elasticmoe.outputs import OutputAccumulator, OutputDelta, RequestOutput
from imm.rank_streams import RankStreams, StreamFailure, portable


def run(coro):
    return asyncio.run(coro)


async def _items(request_id: str, n: int, closed: list[str] | None = None, fail: BaseException | None = None):
    try:
        for i in range(n):
            yield OutputDelta(request_id, [i], f"t{i}", finished=i == n - 1 and fail is None)
            await asyncio.sleep(0)
        if fail is not None:
            raise fail
    finally:
        if closed is not None:
            closed.append(request_id)  # where the rank aborts the request in its engine


def test_one_stream_carries_every_request_of_a_subscriber_in_batches():
    async def main():
        streams = RankStreams(idle_s=0.05)
        streams.submit("ing", "a", _items("a", 5))
        streams.submit("ing", "b", _items("b", 3))
        streams.submit("other", "c", _items("c", 2))
        batches = [batch async for batch in streams.stream("ing")]  # ends once idle
        items = [i for batch in batches for i in batch]
        assert len(batches) < len(items)  # batched, not one item each
        assert [i.new_token_ids[0] for i in items if i.request_id == "a"] == [0, 1, 2, 3, 4]
        assert [i.request_id for i in items if i.finished] == ["b", "a"]
        assert {i.request_id for i in items} == {"a", "b"}  # another subscriber's are not here
        assert [i.request_id for batch in [b async for b in streams.stream("other")] for i in batch] == ["c", "c"]

    run(main())


def test_a_failing_request_fails_alone_and_travels():
    async def main():
        streams = RankStreams(idle_s=0.05)
        streams.submit("ing", "bad", _items("bad", 2, fail=InvalidRequestError("top_k", "too large")))
        streams.submit("ing", "ok", _items("ok", 3))
        items = [i async for batch in streams.stream("ing") for i in batch]
        (failure,) = [i for i in items if isinstance(i, StreamFailure)]
        received = pickle.loads(pickle.dumps(failure))  # crosses to the ingress intact
        assert received.request_id == "bad" and received.error.param == "top_k"
        assert [i.finished for i in items if i.request_id == "ok"][-1]
        with pytest.raises(ValueError, match="already running"):
            streams.submit("ing", "x", _items("x", 1))
            streams.submit("ing", "x", _items("x", 1))

    run(main())


def test_cancel_stops_a_pump_and_closes_its_request():
    async def main():
        streams = RankStreams(idle_s=0.05)
        closed: list[str] = []
        streams.submit("ing", "long", _items("long", 10_000, closed))
        await asyncio.sleep(0.01)
        assert await streams.cancel("long") and closed == ["long"]
        assert not await streams.cancel("long") and streams.num_requests("ing") == 0

    run(main())


def test_an_idle_subscription_ends_and_nothing_submitted_after_is_lost():
    async def main():
        streams = RankStreams(idle_s=0.02)
        assert [b async for b in streams.stream("ing")] == []  # no request: ends after idle_s
        streams.submit("ing", "late", _items("late", 2))
        assert [i.request_id for b in [b async for b in streams.stream("ing")] for i in b] == ["late", "late"]

    run(main())


def test_close_ends_every_subscription_at_once_after_what_was_put():
    """A rank that shut down (its process may host another rank next) ends its subscribers' streams
    without their idle wait, delivering what its outboxes still hold."""

    async def main():
        streams = RankStreams(idle_s=60)  # an idle end would take a minute
        streams.submit("ing", "a", _items("a", 2))
        reader = asyncio.create_task(_collect(streams.stream("ing")))
        idle = asyncio.create_task(_collect(streams.stream("other")))
        await asyncio.sleep(0.05)
        streams.close()
        got, nothing = await asyncio.wait_for(asyncio.gather(reader, idle), 5)
        assert [i.request_id for i in got] == ["a", "a"] and nothing == []

    run(main())


async def _collect(stream) -> list:
    return [item async for batch in stream for item in batch]


def test_unpicklable_errors_become_descriptions():
    class Local(Exception):
        def __reduce__(self):
            raise TypeError("no")

    assert isinstance(portable(Local("boom")), RuntimeError) and "boom" in str(portable(Local("boom")))
    err = InvalidRequestError("seed", "out of range")
    assert portable(err) is err


class _Ref:
    def __init__(self, value):
        self.value = value

    def __await__(self):
        async def get():
            if isinstance(self.value, BaseException):
                raise self.value
            return self.value

        return get().__await__()


class _FakeRank:
    """`outputs.remote(subscriber)` yields the scripted subscriptions' batches, one list per call."""

    def __init__(self, subscriptions):
        self.subscriptions = list(subscriptions)
        self.outputs = self

    def remote(self, subscriber):
        batches = self.subscriptions.pop(0)

        async def gen():
            for batch in batches:
                await asyncio.sleep(0)
                if isinstance(batch, BaseException):
                    raise batch
                yield _Ref(batch)

        return gen()


def test_a_channel_demultiplexes_and_resubscribes_after_an_idle_end():
    async def main():
        rank = _FakeRank([
            [[OutputDelta("a", [1], "x"), OutputDelta("z", [9], "?")]],  # z: nobody waits for it
            [[OutputDelta("a", [2], "y", finished=True), OutputDelta("b", [3], "w")]],
        ])
        channel = RankChannel(rank, "ing")
        a, b = channel.register("a"), channel.register("b")
        got = [await a.get(), await a.get(), await b.get()]
        assert [(d.request_id, d.new_token_ids) for d in got] == [("a", [1]), ("a", [2]), ("b", [3])]
        channel.unregister("a")
        channel.unregister("b")
        await channel.close()

    run(main())


def test_a_failed_channel_fails_every_request_on_it():
    async def main():
        channel = RankChannel(_FakeRank([[[OutputDelta("a", [1], "x")], ConnectionError("rank died")]]), "ing")
        a, b = channel.register("a"), channel.register("b")
        assert (await a.get()).new_token_ids == [1]
        for queue in (a, b):
            item = await queue.get()
            assert isinstance(item, ChannelClosed) and isinstance(item.cause, ConnectionError)
        assert channel.queues == {}

    run(main())


def test_the_accumulator_rebuilds_outputs_from_deltas():
    acc = OutputAccumulator([5, 6], output_token_ids=[1], text="a")  # resumed: the client had "a"
    first = acc.add(OutputDelta("r", [2], "b"))
    last = acc.add(OutputDelta("r", [3], "c", finished=True, finish_reason="length"))
    assert isinstance(first, RequestOutput) and first.new_text == "b" and first.num_prompt_tokens == 2
    assert last.output_token_ids == [1, 2, 3] and last.text == "abc" and acc.num_chars == 3
    assert last.finish_reason == "length" and last.num_output_tokens == 3
    full = RequestOutput("r", [5, 6], [3], "c", [1, 2, 3], "abc", finished=True)
    assert len(pickle.dumps(OutputDelta.of(full))) < len(pickle.dumps(full))


def test_one_channel_per_rank_while_it_is_in_use():
    from coordinator.rank_channels import RankChannels

    async def main():
        channels = RankChannels("ing")
        rank, other = _FakeRank([[[OutputDelta("a", [1], "x", finished=True)]]]), _FakeRank([])
        first = channels.of(rank)
        assert channels.of(rank) is first  # a second request to it shares its subscription
        queue = first.register("a")
        assert (await queue.get()).finished
        first.unregister("a")
        await first.close()
        channels.of(other)  # idle channels of other ranks are dropped
        assert list(channels._channels) == [other]

    run(main())


def test_the_calls_made_once_per_request_record_no_ray_task_events():
    # The GCS keeps every task's events (up to 100,000): one per request grew its memory by ~3 KB
    # a request served. The long-lived stream and the periodic calls keep theirs.
    from imm.rank import InstanceRank

    for name in ("submit", "resume_into", "abort", "generate", "resume"):
        assert getattr(InstanceRank, name).__ray_enable_task_events__ is False, name
    assert not hasattr(InstanceRank.outputs, "__ray_enable_task_events__")

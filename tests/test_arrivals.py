"""When an idle engine's first pass starts (`kev_engine.core.arrivals`): the quiet window and how it adapts
(on an injected clock), and callers who arrive together sharing one pass — announced callers,
and an event loop's tasks submitting in one turn — without `hold()`.

No test races a clock: the window is a microsecond (nothing relies on it), and an announcement's
bound is raised to a minute, so only the announcements decide the pass; the controls show that
without them the same callers take several passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import tiny_model

from kev_engine import Engine
from kev_engine.core import arrivals
from kev_engine.core.arrivals import Arrivals

MINUTE = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lone_request_waits_the_window_a_burst_its_last_member() -> None:
    clock = Clock()
    a = Arrivals(0.005, clock)
    a.arrived()
    assert a.start_at() == pytest.approx(100.005)
    clock.now = 100.004
    a.arrived()  # a second caller inside the window: the window restarts from it
    assert a.start_at() == pytest.approx(100.009)


def test_an_announced_caller_holds_the_first_pass_until_it_ends_or_expires() -> None:
    clock = Clock()
    a = Arrivals(0.005, clock)
    a.arrived()
    token = a.announce()
    assert a.start_at() == pytest.approx(100 + arrivals.ANNOUNCED_MAX_S)
    a.end(token)
    a.end(token)  # twice is harmless
    assert a.start_at() == pytest.approx(100.005)
    a.announce()  # never ended: it expires
    clock.now = 100 + arrivals.ANNOUNCED_MAX_S + 1
    assert a.start_at() < clock.now


def test_stragglers_widen_the_window_and_quiet_bursts_narrow_it_back() -> None:
    clock = Clock()
    a = Arrivals(0.005, clock)
    a.arrived()
    a.first_pass(running=True)
    clock.now += 0.012  # a member of the burst arrived 12 ms after the last one, during the first pass
    a.arrived()
    a.first_pass(running=False)
    assert a.window_s == pytest.approx(0.012 * arrivals.GROWTH)
    a.first_pass(running=True)
    clock.now += 10.0  # much later: another request, not a straggler
    a.arrived()
    a.first_pass(running=False)
    assert a.window_s < 0.012 * arrivals.GROWTH
    for _ in range(40):
        a.first_pass(running=True)
        a.first_pass(running=False)
    assert a.window_s == pytest.approx(0.005)  # back to the base, never under it
    a.first_pass(running=True)
    clock.now += 0.9 * a.max_window_s  # times GROWTH is past the cap
    a.arrived()
    a.first_pass(running=False)
    assert a.window_s == pytest.approx(a.max_window_s)  # never past the cap


@pytest.fixture
def engine(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setattr(arrivals, "ANNOUNCED_MAX_S", MINUTE)  # only the announcements decide
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name="tiny-llama", coalesce_ms=0.001)
    engine.generate(["warm up"], {"max_tokens": 1})
    yield engine
    engine.close()


def passes(engine: Engine, before: dict[str, Any]) -> int:
    return int(engine.stats()["prefill_passes"] - before["prefill_passes"])


def test_callers_announced_together_share_the_first_pass(engine: Engine) -> None:
    before = engine.stats()
    with engine.arriving():  # as a server does when a request's headers arrive
        first = engine.submit("one question", {"max_tokens": 2})
        time.sleep(0.05)  # the second caller is still on its way: 50,000 windows later
        second = engine.submit("another question", {"max_tokens": 2})
    first.result(MINUTE), second.result(MINUTE)
    assert passes(engine, before) == 1
    # the control: unannounced, the first starts alone, without waiting for anyone (its pass begins
    # while the second caller is still on its way), so the second has a pass of its own
    before = engine.stats()
    first = engine.submit("one question", {"max_tokens": 2})
    deadline = time.monotonic() + MINUTE
    while passes(engine, before) == 0 and time.monotonic() < deadline:  # bounded: never a race with a clock
        time.sleep(0.001)
    assert passes(engine, before) == 1  # it ran without the second, which the announcement made it wait for
    second = engine.submit("another question", {"max_tokens": 2})
    first.result(MINUTE), second.result(MINUTE)
    assert passes(engine, before) == 2


def tasks_submitting(engine: Engine, spread_s: float) -> list[Any]:
    """Four tasks gathered on one event loop, each busy for `spread_s` (tokenizing a long prompt,
    a retriever) on the loop's thread before it submits."""
    async def ask(i: int) -> Any:
        time.sleep(spread_s)  # noqa: ASYNC251 - busy on the loop, as real work before the call is
        return await asyncio.wrap_future(engine.submit(f"question {i}", {"max_tokens": 2}))

    async def main() -> list[Any]:
        return await asyncio.wait_for(asyncio.gather(*(ask(i) for i in range(4))), MINUTE)
    return asyncio.run(main())


def test_tasks_submitting_in_one_event_loop_turn_are_one_pass(engine: Engine) -> None:
    before = engine.stats()
    tasks_submitting(engine, spread_s=0.02)
    assert passes(engine, before) == 1


def test_the_control_without_waiting_for_the_turn_the_tasks_take_several_passes(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tasks, their submits no longer counted as arriving until the loop's next turn: the
    first pass starts with the first task, so the test above can fail."""
    import kev_engine.engine as engine_module

    monkeypatch.setattr(engine_module, "running_loop", lambda: None)
    before = engine.stats()
    tasks_submitting(engine, spread_s=0.05)
    assert passes(engine, before) >= 2


# ---- agent rounds: expected follow-ups ----------------------------------------------------------


def test_an_expected_follow_up_defers_newcomers_once_its_request_runs_until_it_comes() -> None:
    clock = Clock()
    a = Arrivals(0.005, clock)
    waiting = [True]
    token = a.expect(lambda: waiting[0])
    assert not a.defers(queued_at=clock.now)  # its request still queued: it holds nobody back
    waiting[0] = False  # admitted: the round is under way
    assert a.defers(queued_at=clock.now)
    clock.now += arrivals.FOLLOW_UP_WAIT_S
    assert not a.defers(queued_at=clock.now - arrivals.FOLLOW_UP_WAIT_S)  # nobody waits longer than this
    a.answered(token)
    clock.now += arrivals.FOLLOW_UP_GRACE_S / 2
    assert a.defers(queued_at=clock.now)  # answered: its caller is running the tool
    assert a.arrived(follow_up=True)  # ... and here it is: the longest-answered expectation is met
    assert not a.defers(queued_at=clock.now)
    assert not a.arrived(follow_up=True)  # nothing answered is open: nobody's follow-up


def test_an_answer_nobody_follows_up_stops_deferring_after_the_grace_or_at_once() -> None:
    clock = Clock()
    a = Arrivals(0.005, clock)
    first, second = a.expect(lambda: False), a.expect(lambda: False)
    a.answered(first)
    a.unexpect(second)  # the second answer called no tool: nobody comes back
    a.unexpect(second)  # twice is harmless
    assert a.defers(queued_at=clock.now)
    clock.now += arrivals.FOLLOW_UP_GRACE_S
    assert not a.defers(queued_at=clock.now)  # the first never came back: no longer waited for


def test_a_deferred_follow_up_stays_queued_for_that_pass() -> None:
    from test_schedule import request

    from kev_engine.core.blocks import BlockManager
    from kev_engine.core.schedule import Scheduler

    scheduler = Scheduler(max_batch_tokens=64, max_num_seqs=8, blocks=BlockManager(num_blocks=16, block_size=4))
    running, follow_up = request(0, [1, 2, 3]), request(1, [4, 5, 6])
    scheduler.add([running])
    scheduler.schedule()
    scheduler.add([follow_up])
    planned = [c.request for c in scheduler.schedule(defer=lambda r: r is follow_up)]
    assert planned == [running] and scheduler.waiting == [follow_up]  # the running one goes on, it waits
    planned = [c.request for c in scheduler.schedule(defer=lambda r: False)]
    assert follow_up in planned and not scheduler.waiting


def test_only_a_follow_up_meets_an_expectation() -> None:
    clock = Clock()
    a = Arrivals(0.005, clock)
    token = a.expect(lambda: False)
    a.answered(token)
    assert not a.arrived()  # another caller's question: the expectation stays open
    assert a.arrived(follow_up=True)  # the agent's next question meets it
    assert not a.arrived(follow_up=True)


def test_a_follow_up_never_waits_for_expectations_said_after_it_came() -> None:
    """An answer nobody followed up (an agent that stopped after its tool) leaves its expectation
    open for the grace: the next request counts as its follow-up, and must not then wait for the
    requests that arrived with it (a later round, expected only after it came)."""
    clock = Clock()
    a = Arrivals(0.005, clock)
    stale = a.expect(lambda: False)
    a.answered(stale)
    clock.now += 0.01
    assert a.arrived(follow_up=True)
    queued_at = clock.now
    clock.now += 0.001
    a.expect(lambda: False)  # its neighbours', said after it came
    assert not a.defers(queued_at)

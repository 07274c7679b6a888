"""Callbacks off the scheduler thread (issue 23, item 12): a slow `on_text` delays only its own
request; each request's pieces arrive in order and its result after the last one.

No clock decides anything here: a blocked callback waits on an event the test sets once the
other requests are answered, and every wait is bounded (a wait that runs out means a stall).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import QUESTIONS, tiny_model
from server_util import serving, wait_for

from kev_engine import Engine, SamplingParams
from kev_engine.core.delivery import Delivery, Mailbox
from kev_integrations.remote import RemoteEngine
from kev_integrations.server import ServerConfig, build_app

TIMEOUT = 60  # seconds; a wait that runs out means a stall
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, coalesce_ms=0, kv_cache_bytes=64 << 20)
    yield engine
    engine.close()


def test_a_blocked_on_text_delays_only_its_own_request(engine: Engine) -> None:
    entered, release = threading.Event(), threading.Event()
    slow_pieces: list[str] = []

    def blocked(piece: str) -> None:
        slow_pieces.append(piece)
        entered.set()
        release.wait(4 * TIMEOUT)  # held until the others are answered (bounded: a stall fails below)

    slow = engine.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=12), on_text=blocked)
    try:
        assert entered.wait(TIMEOUT)
        pieces: list[str] = []
        streamed = engine.submit(QUESTIONS[1], GREEDY, on_text=pieces.append)
        plain = engine.submit(QUESTIONS[2], GREEDY)
        assert plain.result(timeout=TIMEOUT).completion_tokens == 8  # answered while the callback is held
        assert "".join(pieces) == streamed.result(timeout=TIMEOUT).text  # other callbacks still run
        wait_for(lambda: engine.stats()["running"] == 0, TIMEOUT, "the held request to finish computing")
        assert not slow.done() and len(slow_pieces) == 1  # its own text waits for its callback
    finally:
        release.set()
    answer = slow.result(timeout=TIMEOUT)
    assert answer.completion_tokens == 12 and "".join(slow_pieces) == answer.text  # all of it, in order


def test_through_kev_serve_a_blocked_on_text_delays_only_its_own_request(engine: Engine) -> None:
    """RemoteEngine reads one stream for a held batch: its callbacks run off that reader too."""
    entered, release = threading.Event(), threading.Event()

    def blocked(piece: str) -> None:
        entered.set()
        release.wait(4 * TIMEOUT)

    with serving(build_app(engine, ServerConfig(), model_name="tiny")) as url:
        client = RemoteEngine(url, timeout=4 * TIMEOUT)
        try:
            with client.hold():  # one HTTP request, one stream, for both
                slow = client.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=12), on_text=blocked)
                other = client.submit(QUESTIONS[1], GREEDY)
            assert entered.wait(TIMEOUT)
            assert other.result(timeout=TIMEOUT).completion_tokens == 8  # read past the held callback
            assert not slow.done()
        finally:
            release.set()
        try:
            assert slow.result(timeout=TIMEOUT).completion_tokens == 12
        finally:
            client.close()


def test_the_result_comes_after_the_last_piece(engine: Engine) -> None:
    pieces: list[list[str]] = [[] for _ in QUESTIONS]
    at_done: list[str | None] = [None] * len(QUESTIONS)

    def done_callback(index: int) -> Any:
        return lambda _: at_done.__setitem__(index, "".join(pieces[index]))

    with engine.hold():  # one pack: every request's pieces are posted in the same passes
        futures = engine.submit_many(QUESTIONS, GREEDY, on_text=[p.append for p in pieces])
        for index, future in enumerate(futures):
            future.add_done_callback(done_callback(index))
    answers = [f.result(timeout=TIMEOUT) for f in futures]
    wait_for(lambda: None not in at_done, TIMEOUT, "every done callback")
    assert at_done == [a.text for a in answers] == ["".join(p) for p in pieces]


def test_a_raising_on_text_fails_its_request_and_is_not_called_again(engine: Engine) -> None:
    calls: list[str] = []

    def raising(piece: str) -> None:
        calls.append(piece)
        raise RuntimeError("listener went away")

    before = engine.stats()["cancelled"]
    bad = engine.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=40), on_text=raising)
    good = engine.submit(QUESTIONS[1], GREEDY)
    with pytest.raises(RuntimeError, match="listener went away"):
        bad.result(timeout=TIMEOUT)
    assert good.result(timeout=TIMEOUT).completion_tokens == 8
    wait_for(lambda: engine.stats()["running"] == 0, TIMEOUT, "the failed request to leave")
    assert len(calls) == 1 and engine.stats()["cancelled"] == before  # a failure, not a cancellation
    assert engine.stats()["kv_cache_bytes"] == 0


# ---- the pool itself -----------------------------------------------------------------------------


def test_a_mailbox_runs_in_order_and_a_blocked_one_holds_only_itself() -> None:
    delivery = Delivery("test", max_workers=2)
    release, b_done = threading.Event(), threading.Event()
    a, b = Mailbox(), Mailbox()
    log: list[str] = []
    delivery.post(a, lambda: (log.append("a0"), release.wait(TIMEOUT)))
    for i in range(1, 4):
        delivery.post(a, lambda i=i: log.append(f"a{i}"))
    for i in range(3):
        delivery.post(b, lambda i=i: log.append(f"b{i}"))
    delivery.post(b, b_done.set)
    assert b_done.wait(TIMEOUT)  # b ran to its end while a's first job is held
    assert [x for x in log if x.startswith("b")] == ["b0", "b1", "b2"] and "a1" not in log
    release.set()
    wait_for(lambda: "a3" in log, TIMEOUT, "a's remaining jobs")
    assert [x for x in log if x.startswith("a")] == ["a0", "a1", "a2", "a3"]
    delivery.close()


def test_workers_are_bounded_and_a_raising_job_ends_no_thread() -> None:
    delivery = Delivery("test", max_workers=1)
    threads: list[threading.Thread] = []
    finished = threading.Event()
    mailboxes = [Mailbox() for _ in range(5)]

    def interrupt() -> None:
        raise KeyboardInterrupt  # a callback's error is its own, never the pool's

    for box in mailboxes:
        delivery.post(box, lambda: threads.append(threading.current_thread()))
        delivery.post(box, interrupt)
    delivery.post(mailboxes[0], finished.set)
    assert finished.wait(TIMEOUT)  # mailboxes take turns: by then each has run its first job
    assert len(threads) == 5 and len(set(threads)) == 1  # one worker allowed: each mailbox waited for it
    delivery.close()
    after_close = threading.Event()
    delivery.post(Mailbox(), after_close.set)  # posted after close: still run
    assert after_close.wait(TIMEOUT)


def test_a_delivery_thread_knows_it_is_one() -> None:
    delivery = Delivery("test")
    seen: list[bool] = []
    done = threading.Event()
    delivery.post(Mailbox(), lambda: (seen.append(delivery.owns_current_thread()), done.set()))
    assert done.wait(TIMEOUT) and seen == [True] and not delivery.owns_current_thread()
    with pytest.raises(ValueError, match="max_workers=0"):
        Delivery("test", max_workers=0)

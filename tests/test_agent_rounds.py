"""Agents side by side share their rounds' passes: the LangGraph tool agent of
examples/langchain_agent.py (a call forced, then the answer), run with `agent.batch(4)` on the
embedded model, makes 8 LLM calls, and its second round — each agent's question after its tool
ran, arriving as each first answer finishes — shares one pass because ChatKev tells the engine
that a reply calling a tool brings its caller back (`Engine.expect_follow_up`, `kev_engine.core.arrivals`).

No clock race: the follow-up grace and wait are raised to a minute, so only the agents' own
arrivals decide when the second round is admitted (every agent here does come back)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import ToolMessage

from kev_engine import Engine
from kev_engine.core import arrivals
from kev_integrations.langchain import ChatKev

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from langchain_agent import QUESTIONS, get_weather, run  # noqa: E402  (the example's own agent)


def test_four_two_round_agents_take_at_most_three_passes(embedded_engine: Engine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrivals, "FOLLOW_UP_GRACE_S", 60.0)
    monkeypatch.setattr(arrivals, "FOLLOW_UP_WAIT_S", 60.0)
    report = run(ChatKev(engine=embedded_engine, temperature=0, max_tokens=48), QUESTIONS)
    assert all(isinstance(r["messages"][2], ToolMessage) for r in report["results"])  # every agent ran its tool
    assert report["llm_calls"] == 8
    assert report["prefill_passes"] <= 3  # ideal 2; the round's answers, one pass


def test_an_answer_that_calls_no_tool_expects_nobody(embedded_engine: Engine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of what ChatKev tells the engine: a tool call expects its caller back, a plain
    answer (tool_choice none, or no tools) does not — else every later request would wait."""
    expected: list[Any] = []
    real = embedded_engine.expect_follow_up

    def spy(future: Any) -> Any:
        handle = real(future)
        expected.append(handle)
        return handle
    monkeypatch.setattr(embedded_engine, "expect_follow_up", spy)
    llm = ChatKev(engine=embedded_engine, temperature=0, max_tokens=24)
    llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    assert len(expected) == 1 and expected[0]._ending is not None  # still expected: the caller runs its tool
    expected[0].end()
    llm.bind_tools([get_weather], tool_choice="none").invoke("Weather in Paris?")
    llm.invoke("Hello")
    assert len(expected) == 1  # no tools offered: nothing expected

"""Agents side by side share their rounds' passes: a LangGraph tool agent (a call forced, then the
answer) run with `agent.batch(4)` on the embedded model makes 8 LLM calls, and its second round —
each agent's question after its tool ran, arriving as each first answer finishes — shares one
pass because ChatKev tells the engine that a reply calling a tool brings its caller back
(`Engine.expect_follow_up`, `kev_engine.arrivals`).

No clock race: the follow-up grace and wait are raised to a minute, so only the agents' own
arrivals decide when the second round is admitted (every agent here does come back)."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AnyMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition

from kev_engine import Engine, arrivals
from kev_integrations.langchain import ChatKev

QUESTIONS = ["What is the weather in Paris?", "What is 17 plus 25?", "Is it snowing in Oslo?", "Add 3 and 4."]


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return "sunny, 21 C"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def tool_agent(llm: ChatKev) -> Any:
    tools = [get_weather, add]
    ask_tool, answer = llm.bind_tools(tools, tool_choice="any"), llm.bind_tools(tools, tool_choice="none")

    def model(state: State) -> dict[str, list[AnyMessage]]:
        done = any(isinstance(m, ToolMessage) for m in state["messages"])
        return {"messages": [(answer if done else ask_tool).invoke(state["messages"])]}

    graph = StateGraph(State)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


def test_four_two_round_agents_take_at_most_three_passes(embedded_engine: Engine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrivals, "FOLLOW_UP_GRACE_S", 60.0)
    monkeypatch.setattr(arrivals, "FOLLOW_UP_WAIT_S", 60.0)
    agent = tool_agent(ChatKev(engine=embedded_engine, temperature=0, max_tokens=48))
    before = embedded_engine.stats()
    results = agent.batch([{"messages": [("user", q)]} for q in QUESTIONS], config={"recursion_limit": 6})
    after = embedded_engine.stats()
    assert all(isinstance(r["messages"][2], ToolMessage) for r in results)  # every agent ran its tool
    assert after["requests"] - before["requests"] == 8
    assert after["prefill_passes"] - before["prefill_passes"] <= 3  # ideal 2; the round's answers, one pass


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

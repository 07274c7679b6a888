"""A LangGraph agent over two tools, answering several questions at once on the embedded model.

The classic tool loop — model → tools → model — as a LangGraph `StateGraph`, with one policy a
small model needs: on the user's question a tool call is forced (``tool_choice="any"``; the
engine constrains the reply to a valid call of one of the tools), and once a tool has answered
the model writes the answer (``tool_choice="none"``). ``agent.batch(questions)`` runs the
questions side by side; their LLM calls reach the shared engine together, so they share its
packed passes (continuous batching: a call that arrives while a pass runs joins the next one).

    python examples/langchain_agent.py
"""

from __future__ import annotations

import time
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition

from kev_integrations.langchain import ChatKev


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return {"paris": "sunny, 21 C", "oslo": "snow, -3 C", "tokyo": "rain, 17 C"}.get(city.lower(), "cloudy, 15 C")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS: list[BaseTool] = [get_weather, add]
# (question, the tool that answers it)
QUESTIONS = [
    ("What is the weather in Paris?", "get_weather"),
    ("What is 17 plus 25?", "add"),
    ("Is it snowing in Oslo right now?", "get_weather"),
    ("Add 3 and 4.", "add"),
]


class AgentState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def build_agent(llm: ChatKev, tools: list[BaseTool]) -> Any:
    """model → (a call? tools → model) → end; a call is forced until a tool has answered."""
    ask_tool = llm.bind_tools(tools, tool_choice="any")
    answer = llm.bind_tools(tools, tool_choice="none")  # the tools stay known, but no more calls

    def model(state: AgentState) -> dict[str, list[AnyMessage]]:
        has_result = any(isinstance(m, ToolMessage) for m in state["messages"])
        return {"messages": [(answer if has_result else ask_tool).invoke(state["messages"])]}

    graph = StateGraph(AgentState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # → "tools" when the reply calls one, else END
    graph.add_edge("tools", "model")
    return graph.compile()


def first_call(messages: list[AnyMessage]) -> dict[str, Any] | None:
    """The agent's first tool call (None if it made none)."""
    for message in messages:
        if isinstance(message, AIMessage) and message.tool_calls:
            return dict(message.tool_calls[0])
    return None


def run(llm: ChatKev, questions: list[tuple[str, str]]) -> dict[str, Any]:
    """Run the agent on all questions at once; what happened, with the engine's pass counts."""
    engine = llm.get_engine()
    agent = build_agent(llm, TOOLS)
    before, start = engine.stats(), time.perf_counter()
    results = agent.batch([{"messages": [("user", q)]} for q, _ in questions], config={"recursion_limit": 6})
    elapsed, after = time.perf_counter() - start, engine.stats()
    calls = [first_call(r["messages"]) for r in results]
    return {
        "results": results,
        "calls": calls,
        "valid": sum(c is not None for c in calls),
        "right": sum(c is not None and c["name"] == want for c, (_, want) in zip(calls, questions)),
        "llm_calls": after["requests"] - before["requests"],
        "passes": after["forward_passes"] - before["forward_passes"],
        "prefill_passes": after["prefill_passes"] - before["prefill_passes"],
        "generated_tokens": after["generated_tokens"] - before["generated_tokens"],
        "seconds": elapsed,
    }


def main() -> None:
    llm = ChatKev(temperature=0, max_tokens=48)
    llm.get_engine()  # load the shared embedded engine now, outside the timing
    report = run(llm, QUESTIONS)
    for (question, _), result, call in zip(QUESTIONS, report["results"], report["calls"]):
        print(f"Q: {question}")
        if call is not None:
            print(f"   tool_call {call['name']}({call['args']})")
        for message in result["messages"]:
            if isinstance(message, ToolMessage):
                print(f"   tool -> {message.content}")
        print(f"   A: {result['messages'][-1].content.strip()[:120]!r}")
    solo = [run(llm, [question]) for question in QUESTIONS]  # the same agent, one question at a time
    same = sum(r["messages"][-1].content == alone["results"][0]["messages"][-1].content
               for r, alone in zip(report["results"], solo))
    n = len(QUESTIONS)
    print(
        f"\nvalid tool calls {report['valid']}/{n}, right tool {report['right']}/{n}; "
        f"{report['llm_calls']} LLM calls in {report['passes']} engine passes "
        f"({report['prefill_passes']} with prefill), {report['seconds']:.1f} s; one question at a time: "
        f"{sum(r['passes'] for r in solo)} passes ({sum(r['prefill_passes'] for r in solo)} with prefill), "
        f"{sum(r['seconds'] for r in solo):.1f} s; same final answers {same}/{n}"
    )


if __name__ == "__main__":
    main()

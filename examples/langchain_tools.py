"""Agent-style tool calling on Kev: several tool questions answered in ONE packed pass.

`bind_tools` hands the tool schemas to the model's chat template; the embedded SmolLM2 template
ignores tools, so Kev describes them in a system message (Hermes ``<tool_call>`` format) and
parses that format from each reply. The tool calls that parse are then executed.

Be honest about the model: the embedded SmolLM2-135M-Instruct is far too small to call tools
reliably — expect many replies with no (or a wrong) tool call. The plumbing is the point here;
with a tool-trained model (e.g. `ChatKev(model="/models/Qwen2.5-7B-Instruct")`, whose template
supports tools natively) the same code gets real calls.

    python examples/langchain_tools.py
"""

from __future__ import annotations

import time

from langchain_core.tools import tool

from kev_integrations.langchain import ChatKev


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return {"paris": "sunny, 21 C", "oslo": "snow, -3 C"}.get(city.lower(), "cloudy, 15 C")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def convert_currency(amount: float, source: str, target: str) -> float:
    """Convert an amount of money from one currency code to another."""
    rates = {"USD": 1.0, "EUR": 0.92, "JPY": 151.0}
    return round(amount / rates.get(source.upper(), 1.0) * rates.get(target.upper(), 1.0), 2)


TOOLS = {t.name: t for t in (get_weather, add, convert_currency)}
QUESTIONS = [
    "What is the weather in Paris?",
    "What is 17 plus 25?",
    "Convert 100 USD to EUR.",
    "Is it snowing in Oslo right now?",
    "Add 3 and 4.",
    "How many yen is 20 dollars?",
]


def main() -> None:
    llm = ChatKev(temperature=0, max_tokens=64).bind_tools(list(TOOLS.values()), tool_choice="any")
    engine = ChatKev().get_engine()  # the shared embedded engine (loads now, outside the timing)
    before, start = engine.stats(), time.perf_counter()
    replies = llm.batch(QUESTIONS)
    elapsed, after = time.perf_counter() - start, engine.stats()
    called = 0
    for question, reply in zip(QUESTIONS, replies):
        print(f"Q: {question}")
        for call in reply.tool_calls:
            tool_ = TOOLS.get(call["name"])
            try:
                result = tool_.invoke(call["args"]) if tool_ else f"no tool named {call['name']!r}"
            except Exception as exc:  # noqa: BLE001 - a small model's bad arguments are shown, not fatal
                result = f"error: {type(exc).__name__}: {exc}"
            called += tool_ is not None
            print(f"   tool_call {call['name']}({call['args']}) -> {result}")
        for bad in reply.invalid_tool_calls:
            print(f"   invalid tool call: {bad['args']!r} ({bad['error']})")
        if not reply.tool_calls and not reply.invalid_tool_calls:
            print(f"   no tool call; the model said: {reply.content.strip()[:100]!r}")
    print(
        f"\n{len(QUESTIONS)} tool questions, {after['prefill_passes'] - before['prefill_passes']} prefill pass(es), "
        f"{elapsed:.1f} s; {called} valid tool call(s) executed. "
        "(SmolLM2-135M is not a reliable tool caller; use a tool-trained model for real agents.)"
    )


if __name__ == "__main__":
    main()

"""Tool calling on Kev: several tool questions answered in ONE packed pass, every call valid.

`bind_tools` hands the tool schemas to the model's chat template; the embedded SmolLM2 template
ignores tools, so Kev describes them in a system message (Hermes ``<tool_call>`` format). With
``tool_choice="any"`` the engine constrains each reply to one call of a bound tool with
arguments valid for that tool's schema, so every reply parses — even from the 135M model.
Which tool it picks, and with which values, is still the model's choice: the script counts the
right ones. A tool-trained model (e.g. ``ChatKev(model="/models/Qwen2.5-7B-Instruct")``, whose
template renders tools natively) picks far better with the same code.

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
# (question, the tool that answers it)
QUESTIONS = [
    ("What is the weather in Paris?", "get_weather"),
    ("What is 17 plus 25?", "add"),
    ("Convert 100 USD to EUR.", "convert_currency"),
    ("Is it snowing in Oslo right now?", "get_weather"),
    ("Add 3 and 4.", "add"),
    ("How many yen is 20 dollars?", "convert_currency"),
]


def main() -> None:
    llm = ChatKev(temperature=0, max_tokens=64).bind_tools(list(TOOLS.values()), tool_choice="any")
    engine = ChatKev().get_engine()  # the shared embedded engine (loads now, outside the timing)
    before, start = engine.stats(), time.perf_counter()
    replies = llm.batch([q for q, _ in QUESTIONS])
    elapsed, after = time.perf_counter() - start, engine.stats()
    valid = right = 0
    for (question, want), reply in zip(QUESTIONS, replies):
        print(f"Q: {question}")
        valid += bool(reply.tool_calls) and not reply.invalid_tool_calls
        right += any(call["name"] == want for call in reply.tool_calls)
        for call in reply.tool_calls:
            try:
                result = TOOLS[call["name"]].invoke(call["args"])
            except Exception as exc:  # noqa: BLE001 - a tool's own refusal is shown, not fatal
                result = f"error: {type(exc).__name__}: {exc}"
            print(f"   tool_call {call['name']}({call['args']}) -> {result}")
        for bad in reply.invalid_tool_calls:
            print(f"   invalid tool call: {bad['args']!r} ({bad['error']})")
    start = time.perf_counter()
    solo = [llm.invoke(question) for question, _ in QUESTIONS]  # one at a time, for comparison
    solo_elapsed, solo_after = time.perf_counter() - start, engine.stats()
    same = sum([(c["name"], c["args"]) for c in a.tool_calls] == [(c["name"], c["args"]) for c in b.tool_calls]
               for a, b in zip(replies, solo))
    n = len(QUESTIONS)
    print(
        f"\nvalid tool calls {valid}/{n}, right tool {right}/{n}, "
        f"passes {after['forward_passes'] - before['forward_passes']} "
        f"({after['prefill_passes'] - before['prefill_passes']} prefill), {elapsed:.1f} s; one at a time: "
        f"{solo_after['forward_passes'] - after['forward_passes']} passes "
        f"({solo_after['prefill_passes'] - after['prefill_passes']} prefill), {solo_elapsed:.1f} s; "
        f"same calls {same}/{n}"
    )


if __name__ == "__main__":
    main()

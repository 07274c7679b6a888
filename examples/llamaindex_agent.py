"""A LlamaIndex FunctionAgent on Kev: several tool questions at once, their LLM calls packed.

`Kev` is a LlamaIndex `FunctionCallingLLM`: bound tools become a constraint on each reply (the
Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format, the name one of the
tools, the arguments matching that tool's schema), so every call parses by construction — even
from the embedded SmolLM2-135M-Instruct, whose chat template knows nothing of tools. The agents
run side by side with `asyncio.gather`; their LLM calls reach the engine together and share
forward passes. The same questions then run one at a time, for comparison.

    python examples/llamaindex_agent.py
    python examples/llamaindex_agent.py --model DIR     # a larger local model

`initial_tool_choice="required"` makes each agent's first step a tool call (the model picks
which one and its arguments); later steps are free to answer in text or call again.
`allow_parallel_tool_calls=False` allows one call per step: asked for "one or more", a 135M
model repeats its call until max_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.tools import FunctionTool
from pass_counts import passes  # examples/ is on sys.path when a script in it runs

from kev_integrations.llamaindex import Kev


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return {"paris": "sunny, 21 C", "oslo": "snow, -3 C", "tokyo": "rain, 18 C"}.get(city.lower(), "cloudy, 15 C")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


QUESTIONS = {  # question → the tool a right answer calls
    "What is the weather in Paris?": "get_weather",
    "What is 17 plus 25?": "add",
    "Is it snowing in Oslo right now?": "get_weather",
    "Add 3 and 4.": "add",
    "Will I need an umbrella in Tokyo today?": "get_weather",
    "What is 100 plus 250?": "add",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder or hub id (default: embedded SmolLM2-135M)")
    args = parser.parse_args()
    llm = Kev(model=args.model, temperature=0, max_tokens=64)
    engine = llm.get_engine()  # load now, outside the timings
    tools = [FunctionTool.from_defaults(get_weather), FunctionTool.from_defaults(add)]
    agent = FunctionAgent(tools=tools, llm=llm, initial_tool_choice="required", allow_parallel_tool_calls=False)

    async def gathered():
        return await asyncio.gather(*(agent.run(q) for q in QUESTIONS))

    async def one_at_a_time():
        return [await agent.run(q) for q in QUESTIONS]

    before, start = engine.stats(), time.perf_counter()
    results = asyncio.run(gathered())
    packed_s = time.perf_counter() - start
    packed = passes(engine, before)
    before, start = engine.stats(), time.perf_counter()
    serial = asyncio.run(one_at_a_time())
    serial_s = time.perf_counter() - start

    valid = right = 0
    for (question, expected), result in zip(QUESTIONS.items(), results):
        print(f"Q: {question}")
        for call in result.tool_calls:
            valid += 1
            right += call.tool_name == expected
            print(f"   tool call {call.tool_name}({call.tool_kwargs}) -> {call.tool_output.content}")
        print(f"   answer: {str(result).strip()[:120]!r}")
    same = sum(str(a) == str(b) for a, b in zip(results, serial))
    print(f"\n{len(QUESTIONS)} questions: {valid} valid tool calls, {right} of the right tool")
    print(f"gathered:      {packed}, {packed_s:.1f} s")
    print(f"one at a time: {passes(engine, before)}, {serial_s:.1f} s  (gathered {serial_s / packed_s:.1f}x faster)")
    print(f"same answers (greedy): {same}/{len(QUESTIONS)}")


if __name__ == "__main__":
    main()

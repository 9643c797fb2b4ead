"""The OpenAI Agents SDK on HyperServe's Responses API: an agent with a function tool, run to its
answer, then a streamed run. Start a server first (`make serve`), then:

    pip install openai-agents        # not a HyperServe dependency
    python examples/agents_sdk.py

SmolLM2-135M is a small model: it calls the tool when told to (tool_choice "required", reset after
the first call so it can answer), and one call at a time (parallel_tool_calls=False).
"""

import asyncio

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # traces go to OpenAI's servers otherwise


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny, 21 C in {city}"


async def main() -> None:
    client = AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    model = OpenAIResponsesModel(model="smollm2-135m", openai_client=client)
    agent = Agent(name="weather", instructions="You answer weather questions with the tool.", tools=[get_weather],
                  model=model, reset_tool_choice=True,
                  model_settings=ModelSettings(temperature=0, max_tokens=200, tool_choice="required",
                                               parallel_tool_calls=False))
    result = await Runner.run(agent, "What's the weather in Paris?", max_turns=3)
    print([type(item).__name__ for item in result.new_items])  # the call, its output, the answer
    print(result.final_output)

    chat = Agent(name="chat", instructions="Answer briefly.", model=model,
                 model_settings=ModelSettings(temperature=0, max_tokens=300))
    streamed = Runner.run_streamed(chat, "Say hello.")
    async for event in streamed.stream_events():
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
            print(event.data.delta, end="", flush=True)
    print()


if __name__ == "__main__":
    asyncio.run(main())

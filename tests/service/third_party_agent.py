"""An agent written with the OpenAI Agents SDK (openai-agents), pointed at a v100plan service: one function tool,
a model_settings tool_choice naming it, and a run that stops at the first tool call. Run as a child process
by tests/service/test_service_third_party_clients.py (the SDK lives in its own --target folder on PYTHONPATH).

    python tests/service/third_party_agent.py BASE_URL MODEL API_KEY OUT.json

OUT.json: the SDK's version, the JSON schema the SDK sent for the tool, every call the SDK made to the Python
function (its arguments as the function received them), the run's final output and the number of model
responses. Exits 0 only when the run ended; anything else is a traceback on stderr and exit 1.
"""

from __future__ import annotations

import asyncio
import json
import sys
from importlib.metadata import version
from typing import Annotated, Literal

from pydantic import Field


async def main(base_url: str, model: str, api_key: str, out: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # offline: no trace export to anyone's platform
    calls: list[dict] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast for a city.

        Args:
            city: which city.
            days: how many days ahead.
        """
        calls.append({"city": city, "days": days})
        return f"{city}: sunny for {days} days"

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    agent = Agent(name="forecaster", instructions="Answer weather questions with the tool.",
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=160, temperature=0.0),
                  tools=[get_weather], tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(agent, "What is the weather in Paris this week?", max_turns=2)
    with open(out, "w") as fh:
        json.dump({"sdk": "openai-agents", "version": version("openai-agents"),
                   "schema": get_weather.params_json_schema, "strict": get_weather.strict_json_schema,
                   "calls": calls, "final_output": result.final_output,
                   "model_responses": len(result.raw_responses)}, fh)
    await client.close()


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    asyncio.run(main(*sys.argv[1:]))

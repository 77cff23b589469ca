"""Tool calling against the real server and model (SmolLM2-135M, whose ChatML
template has no tools: the server renders them with its shipped chatml-tools
template and reads calls with the hermes parser), through the `openai`
client: every tool_choice mode streamed and not (the client's accumulated
stream is the whole answer), 20 seeded random tool schemas under "required"
and a named choice, greedy and sampled, at once in a KV pool small enough to
retract requests (every call parses and validates against its schema),
parallel calls and a full round trip (calls, tool results, answer), and the bad
inputs' 400s while another request streams on unharmed."""

from __future__ import annotations

import concurrent.futures
import json
import random
from typing import Any

import jsonschema
import openai
import pytest
import requests

from tests.e2e.server_process import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
# the small model calls a tool under "auto" when asked to write the call out
REPEAT = [{"role": "user", "content": 'Repeat exactly: <tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'}]
MARKUP = ("<tool_call", "</tool_call", '{"name"')


@pytest.fixture(scope="module")
def server() -> Any:
    # a KV pool of 3,072 tokens and a very low conservativeness: the busy batch below (20 prompts
    # of 200-550 tokens and a long answer) is admitted past what it then needs, and retracts; no prefix cache, so
    # a request asked twice alone is computed the same way twice
    srv = ServerProcess("--max-running-requests", "20", "--max-total-tokens", "3072",
                        "--schedule-conservativeness", "0.01", "--disable-radix-cache")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


def valid_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """The message's calls, each arguments parsed and validated against its tool's schema."""
    calls = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        calls.append((call.function.name, args))
    return calls


def streamed(client: openai.OpenAI, **args: Any) -> Any:
    with client.chat.completions.stream(**args) as stream:
        for event in stream:
            if event.type == "content.delta":
                assert not any(m in event.delta for m in MARKUP), event.delta
        return stream.current_completion_snapshot.choices[0]


def same_answer(got: Any, want: Any) -> None:
    assert got.finish_reason == want.finish_reason
    assert got.message.content == want.message.content
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []]


@pytest.mark.parametrize("choice,messages", [
    ("required", ASK), ({"type": "function", "function": {"name": "get_time"}}, ASK), ("auto", REPEAT),
    ("none", ASK)], ids=["required", "named", "auto", "none"])
def test_each_tool_choice_streamed_and_not(client: openai.OpenAI, choice: Any, messages: list[Any]) -> None:
    # one after the other, each alone in its batch: greedy decoding then gives the same tokens
    args: dict[str, Any] = dict(model="m", messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                                parallel_tool_calls=False, max_tokens=16 if choice == "none" else 50,
                                temperature=0)
    whole = client.chat.completions.create(**args).choices[0]
    same_answer(streamed(client, **args), whole)
    calls = valid_calls(whole.message)
    if choice == "none":
        assert not calls and whole.message.content
    else:
        assert whole.finish_reason == "tool_calls" and len(calls) == 1 and whole.message.content is None
        if isinstance(choice, dict):
            assert calls[0][0] == "get_time"
        if choice == "auto":
            assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert not any(m in (whole.message.content or "") for m in MARKUP)


WORDS = ["alpha", "bravo", "city", "delta", "echo", "fox", "gold", "hotel", "iris", "jade", "kilo", "lima"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema: 1-3 properties of strings, integers, booleans, enums,
    arrays and (two levels at most) nested objects; some required."""
    names = rng.sample(WORDS, rng.randint(1, 3))
    props: dict[str, Any] = {}
    for name in names:
        kind = rng.choice(["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 2 else []))
        if kind == "string":
            props[name] = {"type": "string", "maxLength": 12}
        elif kind == "integer":
            props[name] = {"type": "integer", "minimum": 0, "maximum": 999}
        elif kind == "boolean":
            props[name] = {"type": "boolean"}
        elif kind == "enum":
            props[name] = {"enum": rng.sample(WORDS, 3)}
        elif kind == "array":
            props[name] = {"type": "array", "items": rng.choice([{"type": "integer", "minimum": 0, "maximum": 99},
                                                                 {"enum": ["x", "y", "z"]}]),
                           "minItems": 1, "maxItems": 3}
        else:
            props[name] = random_schema(rng, depth + 1)
    required = rng.sample(names, rng.randint(1, len(names)))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_random_schemas_in_a_busy_batch_always_give_valid_calls(server: ServerProcess,
                                                                 client: openai.OpenAI) -> None:
    rng = random.Random(20261206)
    jobs = []
    for k in range(20):
        schema = random_schema(rng)
        tool = {"type": "function", "function": {"name": f"tool_{k}", "description": "Record the values",
                                                 "parameters": schema}}
        choice: Any = "required" if k % 2 else {"type": "function", "function": {"name": f"tool_{k}"}}
        sampled = k % 4 >= 2
        jobs.append((schema, dict(model="m", messages=[{"role": "user", "content": f"Record item {k}."}],
                                  tools=[tool], tool_choice=choice, parallel_tool_calls=False,
                                  max_tokens=160, temperature=1.0 if sampled else 0.0, seed=k)))
    retracted_before = sum("Retract requests" in line for line in server.log)
    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:
        # the calls alone are short, so whether they outgrow the pool depended on when they
        # arrived (CI's quiet machine admitted them late and never retracted); a long answer
        # running beside them grows past its reservation (admission expects a share of max_tokens
        # only; not ignore_eos, which reserves all of it) and makes the pool run dry
        filler = pool.submit(client.completions.create, model="m", prompt="Count: 1, 2, 3,", max_tokens=240,
                             temperature=0.0)
        answers = list(pool.map(lambda job: client.chat.completions.create(**job[1]).choices[0], jobs))
        assert filler.result().choices[0].finish_reason == "length"
    for (schema, job), answer in zip(jobs, answers):
        assert answer.finish_reason == "tool_calls", answer
        (call,) = answer.message.tool_calls
        assert call.function.name == job["tools"][0]["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert sum("Retract requests" in line for line in server.log) > retracted_before  # the pool ran dry


def test_parallel_calls_then_their_results_then_the_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=80, temperature=0)
    message = first.choices[0].message
    assert len(valid_calls(message)) >= 2  # parallel calls, each valid
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    results = [{"role": "tool", "tool_call_id": c.id, "content": f"result {k}: sunny, 21 degrees"}
               for k, c in enumerate(message.tool_calls)]
    history = ASK + [message.model_dump(exclude_none=True)] + results
    second = client.chat.completions.create(model="m", messages=history, tools=[WEATHER, TIME], max_tokens=24,
                                            temperature=0)
    answer = second.choices[0]
    assert answer.message.content or answer.message.tool_calls
    valid_calls(answer.message)
    assert not any(m in (answer.message.content or "") for m in MARKUP)
    # the calls and their results are in the prompt
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


BAD_SCHEMA = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"a": {"type": "strin"}}}}}
BAD = [
    ({"tools": [WEATHER, BAD_SCHEMA]}, "tool 'broken': parameters is not a valid JSON schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope'"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot be combined with response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a+"}, "cannot be combined with regex"),
    ({"tools": [WEATHER], "messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "'call_x' matches no earlier assistant tool call"),
]


def test_bad_tool_requests_are_400s_beside_a_request_in_flight(server: ServerProcess,
                                                               client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                parallel_tool_calls=False, max_tokens=60, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(streamed, client, **args)
        for body, expect in BAD:
            r = requests.post(server.url + "/v1/chat/completions",
                              json={"messages": ASK, "max_tokens": 8, **body}, timeout=30)
            assert r.status_code == 400 and expect in r.json()["error"]["message"], r.text
        got = in_flight.result(timeout=120)
    assert got.finish_reason == "tool_calls" and len(valid_calls(got.message)) == 1


def test_an_openai_agents_loop_calls_the_tool_and_answers(server: ServerProcess) -> None:
    """The `openai-agents` SDK (the `test` extra) drives the server as an agent
    framework does: a forced call, the tool run, its result sent back, an answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"sunny and 21 degrees in {city}"

    model = agents.OpenAIChatCompletionsModel(
        model="m", openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", max_tokens=40,
                                                                          temperature=0))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(cities) >= 1 and all(isinstance(c, str) and c for c in cities)
    assert isinstance(result.final_output, str) and result.final_output
    assert not any(m in result.final_output for m in MARKUP)


def test_the_responses_and_messages_apis_force_a_call_that_fits_the_schema(server: ServerProcess,
                                                                          client: openai.OpenAI) -> None:
    """The same forced call through OpenAI's Responses API and Anthropic's
    Messages API (both bridged onto the chat path's tool calling)."""
    anthropic = pytest.importorskip("anthropic")
    fn = WEATHER["function"]
    r = client.responses.create(model="m", input=ASK[0]["content"], max_output_tokens=50, temperature=0,
                                tools=[{"type": "function", **fn}], parallel_tool_calls=False,
                                tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", r.output
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120) as ac:
        m = ac.messages.create(model="m", max_tokens=50, messages=ASK, extra_body={"temperature": 0},
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               tools=[{"name": fn["name"], "description": fn["description"],
                                       "input_schema": fn["parameters"]}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", m.content
    jsonschema.validate(uses[0].input, SCHEMAS["get_weather"])

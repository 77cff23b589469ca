"""Structured output against the real server, as a user tries it: the `openai`
client's response_format (json_schema, json_object), SGLang's /generate
json_schema and regex, streamed and not, and the 400s for grammars that do
not parse or are over a size bound, beside ordinary requests that keep being
served; a one-field schema is not held behind large schemas whose clients
left."""

from __future__ import annotations

import concurrent.futures
import json
import time

import jsonschema
import openai
import pytest
import regex
import requests

from tests.e2e.server_process import ServerProcess

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["English", "French", "German", "Spanish"]}, "maxItems": 3}},
    "required": ["name", "age", "languages"], "additionalProperties": False}


ENUM_BOUND = 9000  # allows the large (slow) schemas below; the default bound is lower


def large_schema(tag: str) -> dict:
    """8,000 enum strings: within the bounds this server is given, and a
    compile of about a second on a free core."""
    return {"type": "object", "properties": {"a": {"enum": [f"value-{i}-{tag}" for i in range(8000)]}},
            "required": ["a"]}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-running-requests", "8", "--max-grammar-enum-values", str(ENUM_BOUND),
                        "--max-grammar-chars", "200000")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def test_openai_response_format_json_schema_gives_valid_json(client):
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model="any", temperature=temperature, seed=3, max_tokens=120,
            messages=[{"role": "user", "content": "Describe a French scientist as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_openai_json_object_and_streamed_completion(client):
    reply = client.chat.completions.create(
        model="any", temperature=0.0, max_tokens=200,
        messages=[{"role": "user", "content": "Give a JSON object with a city and its country."}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    # completions, streamed, SGLang's regex through extra_body
    stream = client.completions.create(model="any", prompt="The year the war ended:", max_tokens=16,
                                       temperature=0.0, stream=True, extra_body={"regex": r"(19|20)\d\d"})
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert regex.fullmatch(r"(19|20)\d\d", text), text


def test_generate_json_schema_and_regex_beside_free_requests(server):
    bodies = [
        {"text": "A person, as JSON:", "sampling_params": {"max_new_tokens": 120, "temperature": 0.7, "seed": 1,
                                                           "json_schema": json.dumps(PERSON)}},
        {"text": "Call me at", "sampling_params": {"max_new_tokens": 24, "temperature": 0.0,
                                                   "regex": r" \(\d{3}\) \d{3}-\d{4}"}},
        {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 24, "temperature": 0.0,
                                                         "ignore_eos": True}},
        {"text": "A person, as JSON:", "stream": True,
         "sampling_params": {"max_new_tokens": 120, "temperature": 0.0, "json_schema": json.dumps(PERSON)}},
    ]

    def post(body):
        r = requests.post(server.url + "/generate", json=body, timeout=300, stream=body.get("stream", False))
        assert r.status_code == 200, r.text
        if not body.get("stream"):
            return r.json()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
        return events[-1]

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        person, phone, free, streamed = pool.map(post, bodies)
    jsonschema.validate(json.loads(person["text"]), PERSON)
    assert regex.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", phone["text"]), phone["text"]
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    jsonschema.validate(json.loads(streamed["text"]), PERSON)


@pytest.mark.parametrize("body,message", [
    ({"text": "x", "sampling_params": {"regex": "(unclosed"}}, "invalid regex"),
    ({"text": "x", "sampling_params": {"json_schema": "{\"type\": 5}"}}, "invalid json_schema"),
    ({"text": "x", "sampling_params": {"ebnf": "root ::= missing"}}, "invalid ebnf"),
    ({"text": "x", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "mutually exclusive"),
    ({"text": "x", "sampling_params": {"structural_tag": "{}"}}, "structural tags are not supported"),
], ids=["regex", "json_schema", "ebnf", "two", "structural_tag"])
def test_a_grammar_that_does_not_parse_is_a_400_and_the_server_keeps_serving(server, body, message):
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    ok = requests.post(server.url + "/generate", timeout=120,
                       json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "regex": "[a-z]+"}})
    assert ok.status_code == 200 and regex.fullmatch("[a-z]+", ok.json()["text"]), ok.text


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("schema,flag", [
    ({"enum": list(range(ENUM_BOUND + 1))}, "--max-grammar-enum-values"),
    ({"type": "string", "description": "x" * 200_001}, "--max-grammar-chars"),
    (nested(40), "--max-grammar-depth"),
], ids=["enum", "chars", "depth"])
def test_a_schema_over_a_size_bound_is_a_400_naming_the_flag(server, client, schema, flag):
    r = requests.post(server.url + "/generate", timeout=60,
                      json={"text": "x", "sampling_params": {"json_schema": json.dumps(schema)}})
    assert r.status_code == 400 and flag in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError, match=flag):
        client.chat.completions.create(
            model="any", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def test_a_one_field_schema_is_not_held_behind_large_schemas_whose_clients_left(server):
    """Twelve large schemas (a compile of about a second each), each client gone
    after at most 1 s, then a one-field schema: it waits at most for the compiles
    already running (the queued ones are dropped, and it would pass them), not
    for twelve, as one compile thread in arrival order made it."""
    def ask(schema: dict, timeout: float) -> requests.Response | None:
        body = {"text": "JSON:", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                     "json_schema": json.dumps(schema)}}
        try:
            return requests.post(server.url + "/generate", json=body, timeout=timeout)
        except requests.exceptions.Timeout:
            return None  # the client left

    warm = {"type": "object", "properties": {"w": {"type": "integer"}}}
    assert ask(warm, 120).status_code == 200  # the grammar backend's start, not counted below
    t0 = time.monotonic()
    assert ask(large_schema("alone"), 120).status_code == 200
    alone = time.monotonic() - t0  # one large schema's compile and answer, here, now
    # the clients leave while the first compiles still run, however fast this machine compiles
    patience = min(1.0, alone / 4)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        gone = [pool.submit(ask, large_schema(str(k)), patience) for k in range(12)]
        answered = [k for k, f in enumerate(gone) if f.result() is not None]
        assert not answered, f"large schemas {answered} were answered within {patience:.2f} s (alone: {alone:.2f} s)"
        t0 = time.monotonic()
        r = ask({"type": "object", "properties": {"a": {"type": "integer"}}}, 120)
        waited = time.monotonic() - t0
    assert r is not None and r.status_code == 200, r
    assert waited < 3 * alone + 2, f"the one-field schema waited {waited:.1f} s; one large schema takes {alone:.1f} s"
    deadline = time.monotonic() + 60  # and the gone clients' requests left the grammar queue
    while requests.get(server.url + "/get_server_info", timeout=10).json()["scheduler"]["num_grammar_queue_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)

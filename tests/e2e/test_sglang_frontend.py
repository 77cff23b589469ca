"""SGLang's own frontend-language test programs (`sglang.test.test_programs`,
from the `sglang` wheel installed with --no-deps, plus `pybase64`, which its
package import needs) against our real server with the default model,
through `sgl.RuntimeEndpoint`: every program that needs no image, no
parallel-encoding endpoint, no API-model backend and no download runs with
no error from the server.

They run at once, each on its own thread (as `run_batch` and forks do
anyway), so the server batches them and the file takes about as long as the
longest program. What each program asserts about the protocol holds as
written. Where a program asserts what a 135M model answers (a capital, a
product, a year), that assertion is recorded, not enforced: the program's
code is run with those `assert` statements turned into records
(`CONTENT_PROGRAMS`), so everything around them still runs and any error
from the server still fails the test.

Not run, and why:
- test_image_qa: multimodal input; test_parallel_encoding: SGLang's
  /concate_and_append_request endpoint.
- test_completion_speculative, test_chat_completion_speculative: speculative
  execution for API backends (OpenAI); a RuntimeEndpoint has no
  `token_usage` / `is_chat_model`, so they fail inside the frontend.
- test_hellaswag_select: downloads its data set.

The server runs with --incremental-streaming-output, as SGLang's CI starts
its own for these programs: test_stream_logprobs asserts that each streamed
event carries only the new output logprobs.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import requests

pytest.importorskip("pybase64")  # sglang's package import needs it
sgl = pytest.importorskip("sglang")
tp = pytest.importorskip("sglang.test.test_programs")

from tests.e2e.server_process import ServerProcess  # noqa: E402

# program -> keyword arguments (SGLang's CI passes check_answer=False to select)
PROGRAMS: dict[str, dict[str, Any]] = {
    "test_few_shot_qa": {}, "test_mt_bench": {}, "test_select": {"check_answer": False},
    "test_decode_int": {}, "test_decode_json_regex": {}, "test_decode_json": {},
    "test_expert_answer": {"check_answer": False}, "test_tool_use": {}, "test_react": {},
    "test_parallel_decoding": {}, "test_stream": {}, "test_regex": {}, "test_dtype_gen": {},
    "test_gen_min_new_tokens": {}, "test_stream_logprobs": {},
}
# their asserts are on what the model answers (test_decode_json*: that a
# 135M model closes its JSON string within the token budget, and that its
# string holds no raw control character: SGLang's REGEX_STR, "[\w\d\s]*",
# admits a newline or tab that json.loads rejects)
CONTENT_PROGRAMS = {"test_few_shot_qa", "test_decode_int", "test_tool_use", "test_react",
                    "test_decode_json_regex", "test_decode_json"}


@dataclass
class Outcome:
    seconds: float = 0.0
    error: BaseException | None = None
    content_misses: list[str] = field(default_factory=list)


def _soft_asserts(fn: Callable[..., Any], misses: list[str]) -> Callable[..., Any]:
    """`fn` recompiled with each `assert X, M` turned into a record of M when X
    is false or cannot be evaluated (int() of an answer that is no number),
    and its `js_obj = json.loads(X)` parsed again without json's strictness
    about control characters in strings when the strict parse fails, which is
    then recorded: any other malformed JSON still fails the program."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))

    class Soften(ast.NodeTransformer):
        def visit_Try(self, node: ast.Try) -> ast.stmt:
            self.generic_visit(node)
            body = node.body[0] if len(node.body) == 1 else None
            if not (isinstance(body, ast.Assign) and isinstance(body.value, ast.Call)
                    and ast.unparse(body.value.func) == "json.loads"):
                return node
            for handler in node.handlers:
                if handler.type is not None and ast.unparse(handler.type) == "json.decoder.JSONDecodeError":
                    lenient = ast.Call(func=ast.Name("_lenient_json", ast.Load()), args=body.value.args, keywords=[])
                    handler.body = [ast.Assign(targets=body.targets, value=lenient)]
            return node

        def visit_Assert(self, node: ast.Assert) -> ast.stmt:
            def thunk(e: ast.expr | None) -> ast.expr:
                body = e if e is not None else ast.Constant("")
                return ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[],
                                                     defaults=[]), body=body)
            call = ast.Call(func=ast.Name("_content_check", ast.Load()),
                            args=[thunk(node.test), thunk(node.msg), ast.Constant(ast.unparse(node.test))],
                            keywords=[])
            return ast.copy_location(ast.Expr(call), node)

    tree = ast.fix_missing_locations(Soften().visit(tree))

    def check(test: Callable[[], Any], msg: Callable[[], Any], source: str) -> None:
        try:
            ok, why = bool(test()), ""
        except Exception as e:  # the answer is not even of the asserted kind
            ok, why = False, repr(e)
        if not ok:
            try:
                detail = str(msg())
            except Exception:
                detail = ""
            misses.append(f"{source}: {detail or why}"[:300])

    def lenient_json(text: str) -> Any:
        obj = json.loads(text, strict=False)  # raises on anything but a control character in a string
        misses.append(f"a raw control character in a JSON string: {text!r}"[:300])
        return obj

    scope = {**vars(tp), "_content_check": check, "_lenient_json": lenient_json}
    exec(compile(tree, inspect.getsourcefile(fn) or "<test_programs>", "exec"), scope)
    return scope[fn.__name__]


def _safe_calculate(expression: str) -> str:
    """test_tool_use's calculator evals what the model wrote: here only + - * /
    of numbers are evaluated, anything else is an answer of 0."""
    node = ast.parse(expression, mode="eval") if expression.strip() else None
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
               ast.USub, ast.UAdd)
    if node is None or not all(isinstance(n, allowed) for n in ast.walk(node)):
        return "0"
    return str(eval(compile(node, "<calc>", "eval"), {"__builtins__": {}}))


def _install_client_stubs() -> None:
    """test_gen_min_new_tokens counts the answer's tokens with
    sglang.srt's get_tokenizer, whose module imports torchvision: the same
    Hugging Face tokenizer, loaded by transformers directly."""
    from transformers import AutoTokenizer

    stub = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    stub.get_tokenizer = lambda path, **kw: AutoTokenizer.from_pretrained(path)  # type: ignore[attr-defined]
    sys.modules.setdefault("sglang.srt.utils.hf_transformers_utils", stub)


def _run(name: str) -> Outcome:
    out = Outcome()
    fn = getattr(tp, name)
    if name in CONTENT_PROGRAMS:
        fn = _soft_asserts(fn, out.content_misses)
    start = time.perf_counter()
    try:
        fn(**PROGRAMS[name])
    except BaseException as e:  # noqa: BLE001 - reported by the program's test
        out.error = e
    out.seconds = time.perf_counter() - start
    return out


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--incremental-streaming-output", startup_timeout=300.0)
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def outcomes(server) -> dict[str, Outcome]:
    _install_client_stubs()
    backend = sgl.RuntimeEndpoint(server.url)
    backend.endpoint = backend  # test_gen_min_new_tokens reads the model path as a Runtime's
    sgl.set_default_backend(backend)
    original_eval = vars(tp).get("eval")
    tp.eval = _safe_calculate  # module globals come before builtins in test_tool_use's calculate
    try:
        with ThreadPoolExecutor(max_workers=len(PROGRAMS)) as pool:
            futures = {name: pool.submit(_run, name) for name in PROGRAMS}
            results = {name: f.result() for name, f in futures.items()}
        print("seconds per program:", {n: round(o.seconds, 1) for n, o in results.items()})
    finally:
        if original_eval is None:
            del tp.eval
    return results


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_sglang_frontend_program_runs_against_the_server(outcomes, name):
    out = outcomes[name]
    if out.content_misses:
        print(f"{name}: content assertions not met by the small model: {out.content_misses}")
    assert out.error is None, f"{name} failed after {out.seconds:.1f}s: {out.error!r}"


def test_incremental_streaming_events_carry_only_what_is_new(server):
    """--incremental-streaming-output: the events' texts, ids and output
    logprobs concatenate to the plain answer; output_token_logprobs_length
    counts all so far."""
    body = {"text": "The capital of France is", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    # The prompt cached first, so the plain answer and the stream prefill the
    # same last token over the same cached prefix: the same computation, the
    # same logprobs (a cold prefill's matmul shapes differ, and in bfloat16 on a
    # CPU without AMX so do the last bits of the logprobs).
    requests.post(server.url + "/generate", json=body, timeout=120).raise_for_status()
    whole = requests.post(server.url + "/generate", json=body, timeout=120).json()
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: {")]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [i for e in events for i in e["output_ids"]] == whole["output_ids"]
    assert [lp for e in events for lp in e["meta_info"]["output_token_logprobs"]] == \
        whole["meta_info"]["output_token_logprobs"]
    assert [e["meta_info"]["output_token_logprobs_length"] for e in events] == \
        [e["meta_info"]["completion_tokens"] for e in events]


def _program_parsing_json(text: str) -> Any:
    """The shape of SGLang's test_decode_json and test_decode_json_regex after their generation."""
    try:
        js_obj = json.loads(text)
    except json.decoder.JSONDecodeError:
        print("JSONDecodeError", text)
        raise
    assert isinstance(js_obj["name"], str)
    return js_obj


def test_a_raw_control_character_in_a_json_string_is_recorded_and_other_bad_json_still_fails() -> None:
    misses: list[str] = []
    program = _soft_asserts(_program_parsing_json, misses)
    assert program('{"name": "Paris"}') == {"name": "Paris"} and misses == []
    assert program('{"name": "Paris\tFrance"}') == {"name": "Paris\tFrance"}  # a raw tab: REGEX_STR admits it
    assert len(misses) == 1 and "control character" in misses[0]
    with pytest.raises(json.JSONDecodeError):
        program('{"name": "Paris"')  # unterminated: not the model's content, a broken answer

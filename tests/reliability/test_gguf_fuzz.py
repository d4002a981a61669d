"""Fuzzing GGUF input: every corrupt or unusable model file is refused with one line naming the problem.

In-process, every case goes the way `moestudio validate` and `moestudio serve --engine hybrid` take a
model (`open_model`, which serve also runs before it listens, then the engine's capability check,
then `build_model`) and must end in a UserError (GGUFError is one) whose message names the problem:
never another exception, a hang or an allocation sized by the header. Files this engine accepts
are then loaded by llama.cpp in a child process (the tokenizer every engine uses, and llama.cpp's
own model loader), which must not abort. A handful of cases go through the real CLI in a child
process whose address space is capped 256 MiB above what its imports use, so that a header which
made the loader allocate by its own counts would die with a MemoryError there; each prints one line,
exits 2, and is what the app classifies as a bad model.

Cases are built by taking the tiny qwen3moe apart with gguf-py's reader (an independent parser) and
putting it back together with one thing changed; flips and cuts are seeded. The number of cases run
is printed at the end of the module (docs/RELIABILITY.md records it).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from app.worker_state import Cause, classify_crash
from engine.errors import UserError
from engine.gguf.check import MAX_CONTEXT, MAX_LAYERS, open_model
from engine.gguf.reader import MAX_ARRAY_LEN, MAX_TENSORS
from tests.server.conftest import start_server

ROOT = Path(__file__).resolve().parents[2]
ARCH = "qwen3moe"
FLIPS_PER_REGION = 200
CAP_HEADROOM = 256 << 20  # address space the capped CLI may add to what its imports use
COUNTS: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    started = time.perf_counter()
    yield
    total = sum(COUNTS.values())
    parts = ", ".join(f"{kind} {n}" for kind, n in COUNTS.items())
    line = f"GGUF fuzz: {total} cases ({parts}) in {time.perf_counter() - started:.1f} s"
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:  # this runs in a test's teardown, where output is captured
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(line)


# ---- taking a GGUF apart and putting it back together --------------------------------------------

_PACK = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
         VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def text(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def scalar(vtype: VT, value) -> tuple[VT, bytes]:
    return vtype, struct.pack("<" + _PACK[vtype], value)


def string(s: str | bytes) -> tuple[VT, bytes]:
    return VT.STRING, text(s)


def array(itype: VT, items: list) -> tuple[VT, bytes]:
    body = b"".join(text(x) if itype == VT.STRING else struct.pack("<" + _PACK[itype], x) for x in items)
    return VT.ARRAY, u32(itype) + u64(len(items)) + body


@dataclass
class Tensor:
    name: bytes
    ne: list[int]  # ggml order
    qtype: int
    offset: int  # relative to the data section
    n_dims: int | None = None  # written in place of len(ne) when set

    def encode(self) -> bytes:
        n_dims = len(self.ne) if self.n_dims is None else self.n_dims
        return text(self.name) + u32(n_dims) + b"".join(u64(n) for n in self.ne) + u32(self.qtype) + u64(self.offset)


@dataclass(frozen=True)
class Raw:
    """An edit of the whole file's bytes, for what the parts do not express (the fixed header, a cut)."""
    change: Callable[[bytes], bytes]


@dataclass
class Gguf:
    """A GGUF file as editable parts: metadata as (key, type, encoded value), tensor infos, data."""
    kv: list[tuple[bytes, int, bytes]]
    tensors: list[Tensor]
    data: bytes
    version: int = 3
    header: dict[str, int] = field(default_factory=dict)  # n_tensors / n_kv overrides

    @classmethod
    def parse(cls, path: Path) -> Gguf:
        blob = path.read_bytes()
        reader = gguf.GGUFReader(path)
        kv = []
        for name, f in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            end = f.offset + sum(p.nbytes for p in f.parts)
            kv.append((name.encode(), int(f.types[0]), blob[f.offset + 8 + len(name.encode()) + 4:end]))
        tensors = [Tensor(bytes(t.field.parts[1]), [int(n) for n in t.field.parts[3]], int(t.field.parts[4][0]),
                          int(t.field.parts[5][0])) for t in reader.tensors]
        assert reader.alignment == 32
        return cls(kv, tensors, blob[reader.data_offset:])

    def to_bytes(self) -> bytes:
        head = (b"GGUF" + u32(self.version) + u64(self.header.get("n_tensors", len(self.tensors)))
                + u64(self.header.get("n_kv", len(self.kv))))
        body = head + b"".join(text(k) + u32(t) + v for k, t, v in self.kv)
        body += b"".join(t.encode() for t in self.tensors)
        return body + bytes(-len(body) % 32) + self.data

    def edit(self, change: Callable[[Gguf], object]) -> bytes:
        copy = deepcopy(self)
        change(copy)
        return copy.to_bytes()

    # edits
    def set(self, key: str, typed: tuple[VT, bytes]) -> None:
        entry = (key.encode(), int(typed[0]), typed[1])
        at = [i for i, (k, _, _) in enumerate(self.kv) if k == key.encode()]
        if at:
            self.kv[at[0]] = entry
        else:
            self.kv.append(entry)

    def drop(self, *keys: str) -> None:
        self.kv = [e for e in self.kv if e[0].decode() not in keys]

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name.encode())

    def drop_tensors(self, pattern: str) -> None:
        self.tensors = [t for t in self.tensors if not re.fullmatch(pattern, t.name.decode())]

    def rename_arch(self, arch: str) -> None:
        self.kv = [(k.replace(f"{ARCH}.".encode(), f"{arch}.".encode(), 1), t, v) for k, t, v in self.kv]
        self.set("general.architecture", string(arch))


@pytest.fixture(scope="module")
def parts(tiny) -> Gguf:
    return Gguf.parse(tiny)


def load_like_the_cli(path: Path) -> None:
    """What `moestudio validate` and `moestudio serve --engine hybrid` do with a file before running it."""
    from engine.models import build_model
    from engine.server.loader import unsupported_reason

    mf = open_model(path)
    problem = unsupported_reason(mf)
    if problem:
        raise UserError(problem)
    build_model(mf, "cpu")


def refused(path: Path) -> str:
    """The message a refused file gets; fails the test on anything but a one-line UserError."""
    with pytest.raises(UserError) as info:
        load_like_the_cli(path)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


# ---- truncation ------------------------------------------------------------------------------------

def _field_boundaries(path: Path) -> list[int]:
    """Every offset where a header field starts or ends (the first items of the long tokenizer arrays only)."""
    reader = gguf.GGUFReader(path)
    fields = list(reader.fields.values()) + [t.field for t in reader.tensors]
    out = set()
    for f in fields:
        pos = f.offset
        for i, part in enumerate(f.parts):
            if i < 12 or i == len(f.parts) - 1:
                out.add(pos)
            pos += part.nbytes
        out.add(pos)
    return sorted(out)


def test_truncated_at_every_header_field_boundary_and_in_the_data(tiny, tmp_path):
    blob = tiny.read_bytes()
    reader = gguf.GGUFReader(tiny)
    data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    rng = np.random.default_rng(11)
    header = _field_boundaries(tiny)
    cuts = {c for b in header for c in (b, b + 1)} | set(rng.integers(0, reader.data_offset, 100).tolist())
    cuts |= set(rng.integers(reader.data_offset, data_end, 12).tolist()) | {data_end - 1}
    cuts = sorted(c for c in cuts if c < data_end)
    assert len(header) > 300
    cut_file = tmp_path / "cut.gguf"
    words = re.compile(r"truncated|shorter than a GGUF header|past the end of the file")
    for cut in cuts:
        cut_file.write_bytes(blob[:cut])
        message = refused(cut_file)
        assert words.search(message) and str(cut_file) in message, (cut, message)
    COUNTS["truncations"] += len(cuts)


# ---- bit flips --------------------------------------------------------------------------------------

def _flip_regions(path: Path) -> dict[str, tuple[int, int]]:
    reader = gguf.GGUFReader(path)
    vocab = reader.fields["tokenizer.ggml.tokens"].offset
    infos = reader.tensors[0].field.offset
    return {"fixed header and metadata": (0, vocab), "tokenizer arrays and template": (vocab, infos),
            "tensor infos": (infos, reader.data_offset)}


def _flips(path: Path, seed: int) -> list[list[tuple[int, int]]]:
    """Per case, 1-3 (byte offset, xor mask) pairs, FLIPS_PER_REGION cases in each header region."""
    rng = np.random.default_rng(seed)
    cases = []
    for lo, hi in _flip_regions(path).values():
        for _ in range(FLIPS_PER_REGION):
            at = sorted({int(p) for p in rng.integers(lo, hi, int(rng.integers(1, 4)))})
            cases.append([(p, 1 << int(rng.integers(0, 8))) for p in at])
    return cases


def _apply(fd: int, blob: bytes, flips: list[tuple[int, int]], undo: bool = False) -> None:
    for pos, mask in flips:
        os.pwrite(fd, bytes([blob[pos] if undo else blob[pos] ^ mask]), pos)


@dataclass
class FlipRun:
    work: Path  # a copy of the model that the cases patch in place and restore
    accepted: list[list[tuple[int, int]]] = field(default_factory=list)  # flips this engine built
    refused: list[str] = field(default_factory=list)  # their one-line messages
    failures: list[str] = field(default_factory=list)  # anything but a UserError, or a message that is not one line


@pytest.fixture(scope="module")
def flip_run(tiny, tmp_path_factory) -> FlipRun:
    blob = tiny.read_bytes()
    run = FlipRun(tmp_path_factory.mktemp("flips") / "flipped.gguf")
    shutil.copy(tiny, run.work)
    fd = os.open(run.work, os.O_RDWR)
    try:
        for flips in _flips(tiny, seed=5):
            _apply(fd, blob, flips)
            try:
                load_like_the_cli(run.work)
                run.accepted.append(flips)
            except UserError as e:
                run.refused.append(str(e))
                if not str(e) or "\n" in str(e):
                    run.failures.append(f"flips {flips}: message {str(e)!r}")
            except Exception as e:
                run.failures.append(f"flips {flips}: {type(e).__name__}: {e}")
            finally:
                _apply(fd, blob, flips, undo=True)
    finally:
        os.close(fd)
    COUNTS["bit flips"] += len(run.accepted) + len(run.refused) + len(run.failures)
    return run


def test_bit_flips_in_the_header_are_refused_or_build(flip_run):
    assert flip_run.failures == []
    # Both outcomes happen: a flip in a float or a token's text still builds; one in a length, a count,
    # a type or a name is refused, and the messages say where.
    assert len(flip_run.refused) > len(flip_run.accepted) > 0
    assert any("truncated" in m for m in flip_run.refused) and any("tensor" in m for m in flip_run.refused)


LLAMA_CHILD = r"""
import json, os, sys
from engine.baseline.llama_load import llama_cpp, load_model
from engine.errors import UserError
from engine.runtime.tokenizer import Tokenizer
path, blob_path = sys.argv[1], sys.argv[2]
blob = open(blob_path, "rb").read()
cases = json.load(sys.stdin)
fd = os.open(path, os.O_RDWR)
done = {"loaded": 0, "refused": 0}
for flips in cases:
    for pos, mask in flips:
        os.pwrite(fd, bytes([blob[pos] ^ mask]), pos)
    try:
        tok = Tokenizer(path)
        tok.encode("Hello, world: a test of the tokenizer.")
        tok.render_chat([{"role": "user", "content": "hi"}])
        del tok
        llama_cpp().llama_model_free(load_model(path))
        done["loaded"] += 1
    except UserError:
        done["refused"] += 1
    for pos, _ in flips:
        os.pwrite(fd, blob[pos:pos + 1], pos)
print(json.dumps(done))
"""


def test_llama_cpp_survives_every_file_this_engine_accepts(flip_run, tiny):
    """llama.cpp tokenizes for both engines and runs `--engine llamacpp`: it must never abort on a
    file the header checks let through (one flipped token made two equal strings, and llama.cpp's
    vocabulary loader aborted the process: check.py now refuses that)."""
    accepted = flip_run.accepted
    r = subprocess.run([sys.executable, "-c", LLAMA_CHILD, str(flip_run.work), str(tiny)], input=json.dumps(accepted),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads(r.stdout.splitlines()[-1])
    assert done["loaded"] + done["refused"] == len(accepted) and done["loaded"] > 0
    COUNTS["llama.cpp loads of accepted flips"] += len(accepted)


# ---- named cases --------------------------------------------------------------------------------

def _dup_token(g: Gguf) -> None:
    payload = next(value for key, _, value in g.kv if key == b"tokenizer.ggml.tokens")
    tokens = [t.decode() for t in _strings(payload)]
    tokens[7] = tokens[6]
    g.set("tokenizer.ggml.tokens", array(VT.STRING, tokens))


def _strings(payload: bytes) -> list[bytes]:
    count, pos, out = struct.unpack_from("<Q", payload, 4)[0], 12, []
    for _ in range(count):
        n = struct.unpack_from("<Q", payload, pos)[0]
        out.append(payload[pos + 8:pos + 8 + n])
        pos += 8 + n
    return out


def _non_moe(g: Gguf) -> None:
    g.drop(f"{ARCH}.expert_count", f"{ARCH}.expert_used_count", f"{ARCH}.expert_feed_forward_length")
    g.drop_tensors(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight|blk\.\d+\.ffn_gate_inp\.weight")
    g.rename_arch("qwen3")


def _no_moe_in_layer_1(g: Gguf) -> None:
    """Layer 1 as a dense layer without its dense FFN: only the builder, asking for it, notices."""
    g.drop_tensors(r"blk\.1\.ffn_(\w+_exps|gate_inp)\.weight")


def _tensor_edit(name: str, **changes) -> Callable[[Gguf], None]:
    def edit(g: Gguf) -> None:
        t = g.tensor(name)
        for attr, value in changes.items():
            setattr(t, attr, value(getattr(t, attr)) if callable(value) else value)
    return edit


def _head(offset: int, value: bytes) -> Raw:
    return Raw(lambda b: b[:offset] + value + b[offset + len(value):])


class _NameLength(Tensor):
    """A tensor info that is only a name length, with no name after it."""

    def __init__(self, length: int) -> None:
        super().__init__(b"", [], 0, 0)
        self.length = length

    def encode(self) -> bytes:
        return u64(self.length)


EXPERTS = "blk.0.ffn_gate_exps.weight"
# (id, edit of the parts or of the final bytes, words the message must contain)
CASES: list[tuple[str, Callable[[Gguf], object] | Raw, str]] = [
    # the fixed header
    ("empty file", Raw(lambda b: b""), r"0 bytes, shorter than a GGUF header"),
    ("23 bytes", Raw(lambda b: b[:23]), r"shorter than a GGUF header"),
    ("a text file", Raw(lambda b: b"hello, world\n" * 40), r"not a GGUF file \(starts with b'hell'"),
    ("magic GGML", _head(0, b"GGML"), r"not a GGUF file \(starts with b'GGML'"),
    ("magic gguf", _head(0, b"gguf"), r"not a GGUF file"),
    ("magic zeros", _head(0, bytes(4)), r"not a GGUF file"),
    *[(f"version {v}", _head(4, u32(v)), rf"unsupported GGUF version {v}") for v in (0, 1, 4, 0xFFFFFFFF)],
    ("big-endian version", _head(4, struct.pack(">I", 3)), r"big-endian GGUF files are not supported"),
    # counts
    *[(f"{n} tensors", _head(8, u64(n)), rf"claims {n} tensors") for n in (MAX_TENSORS + 1, 1 << 40, (1 << 64) - 1)],
    *[(f"{n} metadata entries", _head(16, u64(n)), rf"{n} metadata entries") for n in (1 << 40, 1 << 62)],
    ("no metadata", lambda g: g.kv.clear(), r"no general.architecture string; not a model file"),
    ("metadata count 0", lambda g: g.header.update(n_kv=0), r"tensor 'general.architecture' has 8 dimensions"),
    ("one metadata entry too many", lambda g: g.header.update(n_kv=len(g.kv) + 1), r"metadata|tensor|truncated"),
    # The extra tensor's info is read from the padding and data after the table: what it claims (an
    # empty name at an offset inside another tensor, or data past the end) depends on those bytes.
    ("one tensor too many", lambda g: g.header.update(n_tensors=len(g.tensors) + 1),
     r"tensors '' and .* overlap|past the end of the file"),
    ("one tensor too few", lambda g: g.header.update(n_tensors=len(g.tensors) - 1), r"no tensor named|missing"),
    ("overlapping tensors", lambda g: setattr(g.tensor(EXPERTS), "offset", g.tensor("token_embd.weight").offset),
     r"tensors 'blk.0.ffn_gate_exps.weight' and 'token_embd.weight' overlap|tensors 'token_embd.weight' and "
     r"'blk.0.ffn_gate_exps.weight' overlap"),
    ("tensor name of 64 bytes", lambda g: setattr(g.tensors[3], "name", b"x" * 64),
     r"tensor #3 has a name of 64 bytes \(ggml's limit is 63\)"),
    # shapes and types
    ("5 dimensions", _tensor_edit(EXPERTS, ne=[256, 256, 8, 1, 1]), r"has 5 dimensions \(at most 4\)"),
    ("2^32-1 dimensions", _tensor_edit(EXPERTS, n_dims=(1 << 32) - 1), r"has 4294967295 dimensions"),
    ("shape 2^63", _tensor_edit(EXPERTS, ne=[1 << 63 & ~255, 256, 8]), r"past the end of the file"),
    ("shape product overflows 64 bits", _tensor_edit("token_embd.weight", ne=[1 << 32, 1 << 32, 1 << 32], qtype=0),
     r"past the end of the file"),
    ("row not a whole block", _tensor_edit(EXPERTS, ne=[255, 256, 8]), r"row length 255 is not a multiple of the "
                                                                         r"Q4_K block size 256"),
    ("no rows in the embedding", _tensor_edit("token_embd.weight", ne=[256, 0]),
     r"token_embd.weight has 0 rows for a vocabulary of 2048 tokens"),
    ("embedding width", _tensor_edit("token_embd.weight", ne=[128, 2048]), r"token_embd.weight has shape \[2048, 128\]"),
    ("4 experts in one tensor", _tensor_edit(EXPERTS, ne=[256, 256, 4]), r"blk.0.ffn_gate_exps.weight has shape "
                                                                         r"\[4, 256, 256\].*8 experts"),
    ("2-D expert tensor", _tensor_edit(EXPERTS, ne=[256, 2048]), r"blk.0.ffn_gate_exps.weight has shape \[2048, 256\]"),
    ("tensor type 250", _tensor_edit(EXPERTS, qtype=250), r"unknown type 250"),
    ("removed ggml type 4", _tensor_edit(EXPERTS, qtype=4), r"unknown type 4"),
    # offsets and alignment
    ("offset 2^63", _tensor_edit(EXPERTS, offset=1 << 63), r"past the end of the file"),
    ("misaligned offset", _tensor_edit(EXPERTS, offset=lambda o: o + 1), r"offset \d+ is not a multiple of 32"),
    ("offset at the end", lambda g: setattr(g.tensor(EXPERTS), "offset", -(-len(g.data) // 32) * 32),
     r"past the end of the file"),
    *[(f"alignment {a}", lambda g, a=a: g.set("general.alignment", scalar(VT.UINT32, a)),
       rf"general.alignment {a} is not a power of two") for a in (0, 3, 48)],
    ("alignment 2^31", lambda g: g.set("general.alignment", scalar(VT.UINT32, 1 << 31)), r"past the end of the file"),
    ("alignment a string", lambda g: g.set("general.alignment", string("32")), r"general.alignment '32' is not"),
    ("duplicate tensor", lambda g: g.tensors.append(deepcopy(g.tensors[3])), r"appears twice"),
    # strings and arrays
    ("key length 2^63", _head(24, u64(1 << 63)), r"truncated: metadata key #0"),
    ("key length 2^64-1", _head(24, u64((1 << 64) - 1)), r"truncated: metadata key #0"),
    ("string length 2^62", lambda g: g.set("general.name", (VT.STRING, u64(1 << 62) + b"tiny")),
     r"truncated: 'general.name'"),
    ("tensor name length 2^63", lambda g: g.tensors.__setitem__(0, _NameLength(1 << 63)),
     r"truncated: name of tensor #0"),
    ("architecture not UTF-8", lambda g: g.set("general.architecture", string(b"qwen3\xffmoe")),
     r"'general.architecture' is not valid UTF-8"),
    ("architecture a number", lambda g: g.set("general.architecture", scalar(VT.UINT32, 3)),
     r"no general.architecture string"),
    ("value type 99", lambda g: g.kv.insert(3, (b"x.y", 99, b"")), r"'x.y' has unknown value type 99"),
    ("item type 99", lambda g: g.set("x.y", (VT.ARRAY, u32(99) + u64(1))), r"items of 'x.y' has unknown value type 99"),
    ("array of arrays", lambda g: g.set("x.y", (VT.ARRAY, u32(VT.ARRAY) + u64(1))), r"holds arrays"),
    ("array over the item limit", lambda g: g.set("x.y", (VT.ARRAY, u32(VT.UINT8) + u64(MAX_ARRAY_LEN + 1))),
     rf"claims {MAX_ARRAY_LEN + 1} items"),
    ("array past the end", lambda g: g.set("x.y", (VT.ARRAY, u32(VT.UINT64) + u64(MAX_ARRAY_LEN))),
     r"truncated: 'x.y'"),
    ("vocabulary past the end", lambda g: g.set("tokenizer.ggml.tokens", (VT.ARRAY, u32(VT.STRING) + u64(1 << 25))),
     r"strings of 'tokenizer.ggml.tokens' run past the end"),
    ("token length 2^63", lambda g: g.set("tokenizer.ggml.tokens", (VT.ARRAY, u32(VT.STRING) + u64(1) + u64(1 << 63))),
     r"strings of 'tokenizer.ggml.tokens' run past the end"),
    ("duplicate key", lambda g: g.kv.append(g.kv[1]), r"appears twice"),
    ("two equal tokens", _dup_token, r"tokens 6 and 7 of tokenizer.ggml.tokens are the same string"),
    ("no tokens", lambda g: g.set("tokenizer.ggml.tokens", array(VT.STRING, [])), r"0 tokens"),
    # ranges the loaders size things by
    ("block_count 2^40", lambda g: g.set(f"{ARCH}.block_count", scalar(VT.UINT64, 1 << 40)),
     rf"{ARCH}.block_count is 1099511627776, outside 1..{MAX_LAYERS}"),
    ("block_count 0", lambda g: g.set(f"{ARCH}.block_count", scalar(VT.UINT32, 0)), r"block_count is 0, outside"),
    ("block_count 1", lambda g: g.set(f"{ARCH}.block_count", scalar(VT.UINT32, 1)),
     r"blk\.1\.ffn_\w+\.weight belongs to layer 1, but qwen3moe.block_count is 1"),
    ("block_count 3", lambda g: g.set(f"{ARCH}.block_count", scalar(VT.UINT32, 3)), r"no tensor named 'blk.2."),
    ("context_length 2^40", lambda g: g.set(f"{ARCH}.context_length", scalar(VT.UINT64, 1 << 40)),
     rf"context_length is 1099511627776, outside 1..{MAX_CONTEXT}"),
    ("expert_count 2^20", lambda g: g.set(f"{ARCH}.expert_count", scalar(VT.UINT32, 1 << 20)),
     r"expert_count is 1048576, outside"),
    ("expert_count 4", lambda g: g.set(f"{ARCH}.expert_count", scalar(VT.UINT32, 4)),
     r"has shape \[8, 256, 256\].*with 4 experts"),
    ("expert_count 0", lambda g: g.set(f"{ARCH}.expert_count", scalar(VT.UINT32, 0)),
     r"holds experts, but qwen3moe.expert_count is missing or 0"),
    ("expert_used_count 0", lambda g: g.set(f"{ARCH}.expert_used_count", scalar(VT.UINT32, 0)),
     r"expert_used_count is 0; it must be from 1 to qwen3moe.expert_count \(8\)"),
    ("expert_used_count 9", lambda g: g.set(f"{ARCH}.expert_used_count", scalar(VT.UINT32, 9)),
     r"expert_used_count is 9"),
    ("embedding_length 128", lambda g: g.set(f"{ARCH}.embedding_length", scalar(VT.UINT32, 128)),
     r"token_embd.weight has shape \[2048, 256\], not \[n_vocab, 128\]"),
    ("head_count 3 per-layer values", lambda g: g.set(f"{ARCH}.attention.head_count", array(VT.UINT32, [4, 4, 4])),
     r"attention.head_count has 3 per-layer values for 2 layers"),
    ("head_count per layer", lambda g: g.set(f"{ARCH}.attention.head_count", array(VT.UINT32, [4, 4])),
     r"per-layer qwen3moe.attention.head_count is not supported by the MoE Studio engine"),
    # missing pieces, other models
    ("missing expert tensor", lambda g: g.drop_tensors(r"blk\.1\.ffn_up_exps\.weight"),
     r"tensor blk.1.ffn_up_exps.weight is missing \(the other MoE layers have it\)"),
    ("a layer without experts", lambda g: g.drop_tensors(r"blk\.1\.ffn_\w+_exps\.weight"),
     r"layer 1 has a router \(blk.1.ffn_gate_inp.weight\) but no expert tensors"),
    ("a layer without experts or router", _no_moe_in_layer_1, r"no tensor named 'blk.1.ffn_gate_exps.weight'"),
    ("missing router", lambda g: g.drop_tensors(r"blk\.0\.ffn_gate_inp\.weight"),
     r"blk.0.ffn_gate_inp.weight \(the router of MoE layer 0\) is missing"),
    ("missing embedding", lambda g: g.drop_tensors(r"token_embd\.weight"), r"no tensor named 'token_embd.weight'"),
    ("missing output norm", lambda g: g.drop_tensors(r"output_norm\.weight"), r"no tensor named 'output_norm.weight'"),
    ("missing block_count", lambda g: g.drop(f"{ARCH}.block_count"), r"'qwen3moe.block_count' is missing"),
    ("no expert tensors", lambda g: g.drop_tensors(r".*_exps\.weight"), r"is not a Mixture-of-Experts model"),
    ("a dense model", _non_moe, r"is not a Mixture-of-Experts model \(no expert tensors, no qwen3.expert_count\)"),
    ("another architecture", lambda g: g.rename_arch("mamba"),
     r"architecture 'mamba' is not supported by the MoE Studio engine"),
]

# Every key the loaders read as a number, given as the wrong kind of value.
NUMBERS = ["block_count", "context_length", "embedding_length", "expert_count", "expert_used_count",
           "expert_feed_forward_length", "attention.head_count", "attention.head_count_kv",
           "attention.key_length", "attention.value_length", "rope.dimension_count"]
FLOATS = ["attention.layer_norm_rms_epsilon", "rope.freq_base"]
WRONG_INTS = [("a string", string("8")), ("a float", scalar(VT.FLOAT32, 8.5)), ("a bool", scalar(VT.BOOL, True)),
              ("negative", scalar(VT.INT32, -1)), ("an array of strings", array(VT.STRING, ["8", "8"]))]
WRONG_FLOATS = [("a string", string("1e-6")), ("a bool", scalar(VT.BOOL, True)), ("NaN", scalar(VT.FLOAT32, float("nan"))),
                ("infinite", scalar(VT.FLOAT64, float("inf"))), ("an array", array(VT.FLOAT32, [1.0, 2.0]))]
CASES += [(f"{key} {what}", lambda g, k=key, v=value: g.set(f"{ARCH}.{k}", v), rf"metadata {ARCH}.{re.escape(key)} ")
          for key in NUMBERS for what, value in WRONG_INTS]
CASES += [(f"{key} {what}", lambda g, k=key, v=value: g.set(f"{ARCH}.{k}", v), rf"metadata {ARCH}.{re.escape(key)} ")
          for key in FLOATS for what, value in WRONG_FLOATS]


def _build(parts: Gguf, tiny: Path, edit: Callable[[Gguf], object] | Raw) -> bytes:
    return edit.change(tiny.read_bytes()) if isinstance(edit, Raw) else parts.edit(edit)


@pytest.mark.parametrize("case, edit, words", CASES, ids=[c[0] for c in CASES])
def test_named_cases_are_refused_naming_the_problem(case, edit, words, parts, tiny, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_build(parts, tiny, edit))
    message = refused(bad)
    assert re.search(words, message), message
    COUNTS["named cases"] += 1


def test_the_rebuilt_file_is_the_original(parts, tiny, tmp_path):
    """The cases above change one thing each: rebuilding without an edit gives back a working model."""
    same = tmp_path / "same.gguf"
    same.write_bytes(parts.to_bytes())
    load_like_the_cli(same)
    assert same.read_bytes() == tiny.read_bytes()


def test_a_file_that_fails_only_while_loading_is_reported_by_the_server(parts, tiny, tmp_path):
    """What shows only when the builder asks for a tensor (a layer's experts and router gone) shows after
    the server listens: it stays up to say why on /health and in one log line, answers 503, and the app
    reads the error as a bad model."""
    bad = tmp_path / "layer-1-cut.gguf"
    bad.write_bytes(_build(parts, tiny, _no_moe_in_layer_1))
    s = start_server(bad, "--engine", "hybrid")  # this engine's builder asks for the tensor
    try:
        status, health = s.request("GET", "/health")
        assert status == 503 and health["status"] == "error", health
        assert health["error"] == f"cannot read the model: {bad}: no tensor named 'blk.1.ffn_gate_exps.weight'; " \
                                  "the model file is incomplete"
        status, body = s.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert status == 503 and "failed to load" in body["error"]["message"]
        assert classify_crash("", error=health["error"]).cause == Cause.BAD_MODEL
    finally:
        assert s.stop() == 0
    assert "Traceback" not in "".join(s.log) and health["error"] in "".join(s.log)
    COUNTS["named cases"] += 1


def test_unsupported_quant_type(make_model):
    message = refused(make_model(ARCH, QT.IQ4_NL))
    assert "quantization type(s) IQ4_NL are not supported by the MoE Studio engine" in message
    COUNTS["named cases"] += 1


def test_missing_or_unreadable_path(tmp_path):
    assert "no such model file" in refused(tmp_path / "nowhere.gguf")
    assert "no such model file" in refused(tmp_path)  # a directory
    COUNTS["named cases"] += 2


def test_a_corrupt_chat_template_is_a_message_not_an_exception(parts, tmp_path):
    from engine.runtime.tokenizer import Tokenizer

    bad = tmp_path / "template.gguf"
    bad.write_bytes(parts.edit(lambda g: g.set("tokenizer.chat_template", string("{% for m in messages %}{{ m"))))
    load_like_the_cli(bad)  # the header is sound; the template fails when a chat is rendered
    with pytest.raises(UserError, match=r"the chat template of template.gguf failed to render"):
        Tokenizer(bad).render_chat([{"role": "user", "content": "hi"}])
    COUNTS["named cases"] += 1


# ---- the real command line, under an address-space cap -------------------------------------------

CAPPED = r"""
import resource, sys
import psutil
from engine import cli
cli.build_parser()  # imports every subcommand (torch included) before the cap
import engine.models, engine.server.loader, engine.baseline.oracle, engine.runtime.tokenizer
used = psutil.Process().memory_info().vms
resource.setrlimit(resource.RLIMIT_AS, (used + int(sys.argv[1]), used + int(sys.argv[1])))
sys.exit(cli.main(sys.argv[2:]))
"""


def _capped_cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CAPPED, str(CAP_HEADROOM), *args], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_cli_refuses_in_one_line_under_a_memory_cap(parts, tiny, tmp_path):
    files = {
        "tensors": _build(parts, tiny, _head(8, u64(1 << 40))),
        "array": _build(parts, tiny, lambda g: g.set("x.y", (VT.ARRAY, u32(VT.UINT64) + u64(MAX_ARRAY_LEN)))),
        "dense": _build(parts, tiny, _non_moe),
        "types": _build(parts, tiny, lambda g: g.set(f"{ARCH}.block_count", string("two"))),
        "expert": _build(parts, tiny, lambda g: g.drop_tensors(r"blk\.1\.ffn_up_exps\.weight")),
        "tokens": _build(parts, tiny, _dup_token),
    }
    for name, data in files.items():
        (tmp_path / f"{name}.gguf").write_bytes(data)
    runs = {name: ("serve", str(tmp_path / f"{name}.gguf"), "--port", "0") for name in files}
    runs["types"] = ("validate", str(tmp_path / "types.gguf"))
    runs["expert"] = ("plan", str(tmp_path / "expert.gguf"))
    runs["tokens"] = ("chat", str(tmp_path / "tokens.gguf"))  # llama.cpp alone: it used to abort on this file
    procs = {name: _capped_cli(*args) for name, args in runs.items()}  # in parallel: each imports torch
    results = {name: (p.communicate(timeout=120), p.returncode) for name, p in procs.items()}
    for name, ((out, err), code) in results.items():
        assert code == 2 and "Traceback" not in err and "MemoryError" not in err, (name, code, err[-2000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moestudio: error: "), (name, err)
        if runs[name][0] == "serve":
            # What the app reads from a worker that exits like this: a bad model, not bad settings.
            assert classify_crash(err, code).cause == Cause.BAD_MODEL, (name, err)
    assert "not a Mixture-of-Experts model" in results["dense"][0][1]
    assert "qwen3moe.block_count must be a whole number, not str 'two'" in results["types"][0][1]
    assert "blk.1.ffn_up_exps.weight is missing" in results["expert"][0][1]
    assert "tokens 6 and 7 of tokenizer.ggml.tokens are the same string" in results["tokens"][0][1]
    COUNTS["CLI runs under the cap"] += len(runs)


def test_the_cap_leaves_room_for_a_sound_model(tiny):
    """The cap is not what refuses the cases above: under it, a sound model passes the header check
    and the server starts listening."""
    proc = _capped_cli("serve", str(tiny), "--port", "0")
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "serving" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"exited {proc.poll()}"
        assert f"serving {tiny.name}" in line, line
    finally:
        proc.kill()
        proc.wait()

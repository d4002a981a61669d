"""Expert profiles: which experts a workload routes to, saved so the expert cache starts warm.

A profile holds, per MoE layer and expert, a score (the workload-weighted mean share of decode
rows that routed to the expert) and the raw decode counts behind it, plus the identity of the
model it was collected on. Two file formats:

GGUF (metadata only, no tensors; general.architecture = general.type = "moe-profile"):
  moe.profile.version                u32, 1
  moe.profile.ranking_scores         F64 array, row-major [MoE layer (in source.moe_layers order), expert]
  moe.profile.counts                 F64 array, same layout: raw decode-row accesses (absent if unknown)
  moe.profile.source.n_layer         u32, all layers of the model (dense ones included)
  moe.profile.source.moe_layers      u32 array, the layers that route to experts
  moe.profile.source.n_expert        u32
  moe.profile.source.architecture    string  \
  moe.profile.source.file_size       u64      | absent in a geometry-only profile (converted
  moe.profile.source.expert_bytes    u64      | from STRP without a model)
  moe.profile.source.expert_hash     string  /
  moe.profile.workload.families      string array  \
  moe.profile.workload.weights       F64 array      | one entry per family (weights normalized);
  moe.profile.workload.requests      u32 array      | absent when the profile did not come from a corpus
  moe.profile.workload.decode_rows   u64 array     /

STRP v1 (Strata's format, little-endian): b"STRP", u32 version=1, u32 n_layers, u32 n_expert,
u32 slots, u32 n_ranked, n_ranked x (u16 layer, u16 expert) hottest first, then
n_layers x n_expert i32 (rank, -1 if unranked; readers ignore this table, since some writers
put f32 frequencies there). The STRP layer is the model's own layer index and n_layers is the
model's whole layer count, so a leading dense layer (deepseek2) is a row with nothing ranked;
for Strata's models, where every layer is MoE, this is the same numbering. STRP keeps order
only, so a profile read from it scores rank r of n_ranked as (n_ranked - r) / n_ranked, and it
ranks only experts with a positive score (an expert the workload never routed to has no place
in an order). STRP carries no identity: reading one checks geometry, then takes on the model's.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGUFValueType as VT
from gguf import GGUFWriter

from engine.errors import UserError
from engine.gguf.reader import GGUFError, ModelFile

PROFILE_VERSION = 1
GGUF_TYPE = "moe-profile"
STRP_MAGIC = b"STRP"
STRP_VERSION = 1
_STRP_HEADER = struct.Struct("<4sIIIII")
MAX_STRP_DIM = 1 << 16  # u16 layer and expert indices

# Identity hashing reads the head and tail of every expert tensor plus 4 KiB blocks spread
# evenly through them, ~8 MiB of interior in all: any requantization or different checkpoint
# changes it, and checking a 60 GB model costs tens of MiB of reads, not the whole file.
HASH_EDGE = 64 << 10
HASH_BLOCK = 4 << 10
HASH_INTERIOR_BLOCKS = 2048
HASH_SCHEME = "b2s1"  # names the sampling above, so a future scheme cannot be mistaken for this one

MAX_REQUESTS = 10_000
MAX_TOKENS = 32_768


@dataclass(frozen=True)
class ModelIdentity:
    n_layer: int
    moe_layers: tuple[int, ...]
    n_expert: int
    arch: str | None = None  # None: geometry only (STRP carries nothing else)
    expert_bytes: int | None = None
    file_size: int | None = None
    expert_hash: str | None = None

    @classmethod
    def of(cls, mf: ModelFile) -> "ModelIdentity":
        n_expert = mf.arch_key("expert_count", None)
        if not n_expert:
            raise UserError(f"{mf.path} is not a mixture-of-experts model (no {mf.arch}.expert_count)")
        n_layer = int(mf.arch_key("block_count"))
        # Multi-token-prediction layers (nextn) have experts but never route during generation.
        n_trunk = n_layer - int(mf.arch_key("nextn_predict_layers", 0) or 0)
        moe = tuple(i for i in range(n_trunk) if f"blk.{i}.ffn_gate_exps.weight" in mf.tensors)
        names = sorted(n for n in mf.tensors if "_exps." in n)
        return cls(n_layer, moe, int(n_expert), mf.arch, sum(mf.tensors[n].n_bytes for n in names),
                   mf.path.stat().st_size, _expert_hash(mf, names))

    @classmethod
    def geometry(cls, n_layer: int, n_expert: int) -> "ModelIdentity":
        """What STRP knows: every layer MoE, as in the models Strata runs."""
        return cls(n_layer, tuple(range(n_layer)), n_expert)

    def describe(self) -> str:
        moe = "" if len(self.moe_layers) == self.n_layer else f" (MoE: {describe_layers(self.moe_layers)})"
        shape = f"{self.n_layer} layers{moe} × {self.n_expert} experts"
        return f"{self.arch} with {shape}" if self.arch else shape


def describe_layers(layers: tuple[int, ...]) -> str:
    """Layer numbers as spans: (0, 1, 2, 5) is "0-2, 5"."""
    out, start = [], None
    for i, layer in enumerate(layers):
        start = layer if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out) or "none"


def _expert_hash(mf: ModelFile, names: list[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    blocks = max(1, HASH_INTERIOR_BLOCKS // max(1, len(names)))
    for name in names:
        info = mf.tensors[name]
        h.update(f"{name}\0{info.qtype.name}\0{info.shape}\0".encode())
        data = mf.raw(name).reshape(-1)
        interior = len(data) - 2 * HASH_EDGE
        if interior <= blocks * HASH_BLOCK:
            h.update(data)
            continue
        h.update(data[:HASH_EDGE])
        h.update(data[-HASH_EDGE:])
        stride = interior // blocks
        for i in range(blocks):
            start = HASH_EDGE + i * stride
            h.update(data[start:start + HASH_BLOCK])
    return f"{HASH_SCHEME}:{h.hexdigest()}"


@dataclass(frozen=True)
class Workload:
    family: str
    weight: float  # normalized: the weights of a profile's families sum to 1
    requests: int
    decode_rows: int


@dataclass
class ExpertProfile:
    identity: ModelIdentity
    scores: np.ndarray  # float64 [len(identity.moe_layers), n_expert]
    counts: np.ndarray | None = None  # float64, same shape: raw decode-row accesses; None if unknown
    workload: tuple[Workload, ...] = ()

    def __post_init__(self) -> None:
        shape = (len(self.identity.moe_layers), self.identity.n_expert)
        self.scores = np.asarray(self.scores, dtype=np.float64).reshape(shape)
        if self.counts is not None:
            self.counts = np.asarray(self.counts, dtype=np.float64).reshape(shape)

    def ranking(self, slots_per_layer: int | None = None) -> list[tuple[int, int]]:
        """Every (layer, expert), hottest first; ties go to the lower layer, then the lower expert.

        With slots_per_layer, a layer's experts beyond its first N are left out: the order in
        which a cache of N slots per layer fills."""
        rows, experts = np.indices(self.scores.shape)
        order = np.lexsort((experts.ravel(), rows.ravel(), -self.scores.ravel()))
        layers, n_expert = self.identity.moe_layers, self.identity.n_expert
        ranked = [(layers[i // n_expert], int(i % n_expert)) for i in order]
        if slots_per_layer is None:
            return ranked
        taken: dict[int, int] = {}
        out = []
        for layer, expert in ranked:
            if taken.get(layer, 0) < slots_per_layer:
                taken[layer] = taken.get(layer, 0) + 1
                out.append((layer, expert))
        return out

    def top(self, layer: int, n: int) -> list[int]:
        """The n hottest experts of model layer `layer`."""
        if layer not in self.identity.moe_layers:
            raise ValueError(f"layer {layer} is not an MoE layer of this profile")
        row = self.scores[self.identity.moe_layers.index(layer)]
        return [int(e) for e in np.lexsort((np.arange(len(row)), -row))[:n]]


# ---- fitting a profile to a model -------------------------------------------------------------

def fit(profile: ExpertProfile, model: ModelIdentity, source: str = "the profile") -> ExpertProfile:
    """The profile checked against `model`; UserError naming what differs."""
    src = profile.identity
    mismatch = UserError(f"{source} is for {src.describe()}; this model is {model.describe()}")
    other_arch = src.arch is not None and src.arch != model.arch
    if other_arch or (src.n_layer, src.n_expert) != (model.n_layer, model.n_expert):
        raise mismatch
    if src.moe_layers != model.moe_layers:
        # Only a geometry-only profile may name layers the model computes densely, and then
        # only if it ranks nothing there (STRP numbers every layer).
        if src.arch is not None or not set(model.moe_layers) <= set(src.moe_layers):
            raise mismatch
        rows = [src.moe_layers.index(layer) for layer in model.moe_layers]
        dense = [layer for i, layer in enumerate(src.moe_layers) if i not in rows and profile.scores[i].any()]
        if dense:
            raise UserError(f"{source} ranks experts of layer {dense[0]}, which this model ({model.describe()}) "
                            "computes without experts")
        counts = profile.counts[rows] if profile.counts is not None else None
        profile = ExpertProfile(replace(src, moe_layers=model.moe_layers), profile.scores[rows], counts,
                                profile.workload)
    if src.expert_hash is not None and src.expert_hash != model.expert_hash:
        raise UserError(f"{source} was collected on another {src.arch} file of the same shape (expert weights "
                        f"differ: {src.expert_hash} vs {model.expert_hash}); collect a profile for this model, or "
                        "convert this one to STRP, which carries no identity")
    if src.arch is None:
        return ExpertProfile(model, profile.scores, profile.counts, profile.workload)
    return profile


def read_profile(path: str | os.PathLike[str]) -> ExpertProfile:
    """A profile file of either format, unchecked (STRP: geometry-only identity)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        # Not "no such file": the app's crash classifier takes those words for a missing model.
        raise UserError(f"expert profile {path} does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read profile {path}: {e.strerror}") from None
    if magic == STRP_MAGIC:
        strp = read_strp(path)
        return ExpertProfile(ModelIdentity.geometry(strp.n_layers, strp.n_expert), strp.scores())
    if magic == b"GGUF":
        return read_gguf(path)
    if len(magic) < 4:
        raise UserError(f"{path} is not an expert profile: the file is empty or truncated ({len(magic)} bytes)")
    raise UserError(f"{path} is not an expert profile (starts with {magic!r}; expected b'STRP' or b'GGUF')")


def load_profile(path: str | os.PathLike[str], model: ModelFile | ModelIdentity) -> ExpertProfile:
    """A profile file of either format, checked against `model` (refusals are UserErrors)."""
    identity = model if isinstance(model, ModelIdentity) else ModelIdentity.of(model)
    return fit(read_profile(path), identity, f"profile {path}")


def profile_format(path: str | os.PathLike[str], slots: int | None = None) -> str:
    """"gguf" or "strp" by the file's suffix; UserError for anything else or misplaced slots."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("gguf", "strp"):
        raise UserError(f"{path}: a profile file must end in .gguf or .strp")
    if slots is not None and fmt != "strp":
        raise UserError("slots apply to STRP output only (a GGUF profile keeps every score)")
    if slots is not None and not 1 <= slots < 1 << 32:
        raise UserError(f"slots must be between 1 and {(1 << 32) - 1}, not {slots}")
    if not path.parent.is_dir():
        raise UserError(f"cannot write {path}: no such directory {path.parent}")
    return fmt


def save_profile(profile: ExpertProfile, path: str | os.PathLike[str], slots: int | None = None) -> None:
    """Writes GGUF or STRP by the file's suffix; `slots` (STRP only) caps the ranked entries.

    Atomic: the profile goes to a ".partial" file beside `path`, is flushed to the disk, and then
    renamed over `path`, so a full disk, a crash or a power cut leaves the previous file whole."""
    path = Path(path)
    fmt = profile_format(path, slots)
    partial = path.with_name(path.name + ".partial")
    try:
        partial.unlink(missing_ok=True)  # a stale one from a killed run; never write through a link
        if fmt == "strp":
            write_strp(profile, partial, slots)
        else:
            write_gguf(profile, partial)
        fd = os.open(partial, os.O_RDWR)  # writable: Windows cannot flush a read-only handle
        try:
            os.fsync(fd)  # the data is on the disk before the rename makes it the profile
        finally:
            os.close(fd)
        os.replace(partial, path)
        _fsync_dir(path.parent)
    except BaseException as e:  # a full disk, or Ctrl-C mid-write: no half-written file left behind
        partial.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UserError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def _fsync_dir(directory: Path) -> None:
    """Makes a rename in `directory` durable; some filesystems cannot fsync a directory (then the rename
    is as durable as they make it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- GGUF ---------------------------------------------------------------------------------------

def write_gguf(profile: ExpertProfile, path: Path) -> None:
    src = profile.identity
    w = GGUFWriter(path, GGUF_TYPE)
    w.add_type(GGUF_TYPE)
    w.add_uint32("moe.profile.version", PROFILE_VERSION)

    def f64(key: str, values) -> None:
        # gguf-py would store Python floats as F32; the keys are specified as F64.
        w.add_key_value(key, [float(v) for v in values], VT.ARRAY, sub_type=VT.FLOAT64)

    f64("moe.profile.ranking_scores", profile.scores.ravel())
    if profile.counts is not None:
        f64("moe.profile.counts", profile.counts.ravel())
    w.add_uint32("moe.profile.source.n_layer", src.n_layer)
    w.add_key_value("moe.profile.source.moe_layers", list(src.moe_layers), VT.ARRAY, sub_type=VT.UINT32)
    w.add_uint32("moe.profile.source.n_expert", src.n_expert)
    if src.arch is not None:
        w.add_string("moe.profile.source.architecture", src.arch)
        w.add_uint64("moe.profile.source.file_size", src.file_size)
        w.add_uint64("moe.profile.source.expert_bytes", src.expert_bytes)
        w.add_string("moe.profile.source.expert_hash", src.expert_hash)
    if profile.workload:
        w.add_key_value("moe.profile.workload.families", [x.family for x in profile.workload], VT.ARRAY,
                        sub_type=VT.STRING)
        f64("moe.profile.workload.weights", [x.weight for x in profile.workload])
        w.add_key_value("moe.profile.workload.requests", [x.requests for x in profile.workload], VT.ARRAY,
                        sub_type=VT.UINT32)
        w.add_key_value("moe.profile.workload.decode_rows", [x.decode_rows for x in profile.workload], VT.ARRAY,
                        sub_type=VT.UINT64)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def read_gguf(path: Path) -> ExpertProfile:
    try:
        mf = ModelFile.open(path)
    except GGUFError as e:
        raise UserError(f"corrupt profile: {e}") from None

    def fail(problem: str) -> UserError:
        return UserError(f"{path}: {problem}")

    def get(key: str, kind: type, items: tuple[type, ...] = (), optional: bool = False):
        """metadata[key] if it is a `kind` (a list: of `items`); bools are never numbers here."""
        value = mf.get(key)
        if value is None and optional:
            return None
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if ok and kind is list:
            ok = all(isinstance(v, items) and not isinstance(v, bool) for v in value)
        if not ok:
            raise fail(f"moe.profile key {key!r} is missing or of the wrong type")
        return value

    version = mf.get("moe.profile.version")
    if version is None:
        raise fail("a GGUF file but not an expert profile (no moe.profile.version)")
    if type(version) is not int or version != PROFILE_VERSION:  # 1.0 or True is not the u32 1
        raise fail(f"expert profile version {version!r} is not supported (this reader knows {PROFILE_VERSION})")
    n_layer, n_expert = get("moe.profile.source.n_layer", int), get("moe.profile.source.n_expert", int)
    moe_layers = tuple(get("moe.profile.source.moe_layers", list, (int,)))
    if n_layer < 1 or n_expert < 1 or not moe_layers or list(moe_layers) != sorted(set(moe_layers)) \
            or not 0 <= moe_layers[0] <= moe_layers[-1] < n_layer:
        raise fail(f"inconsistent geometry: {n_layer} layers, MoE layers {list(moe_layers)[:8]}, {n_expert} experts")
    arch = get("moe.profile.source.architecture", str, optional=True)
    identity = ModelIdentity(n_layer, moe_layers, n_expert)
    if arch is not None:
        identity = replace(identity, arch=arch, file_size=get("moe.profile.source.file_size", int),
                           expert_bytes=get("moe.profile.source.expert_bytes", int),
                           expert_hash=get("moe.profile.source.expert_hash", str))
    size = len(moe_layers) * n_expert

    def table(key: str, optional: bool = False) -> np.ndarray | None:
        values = get(key, list, (int, float), optional)
        if values is None:
            return None
        a = np.asarray(values, dtype=np.float64)
        if a.shape != (size,):
            raise fail(f"{key} has {len(values)} values; {len(moe_layers)} MoE layers × {n_expert} experts need {size}")
        if not np.isfinite(a).all() or (a < 0).any():
            raise fail(f"{key} holds negative or non-finite values")
        return a

    scores, counts = table("moe.profile.ranking_scores"), table("moe.profile.counts", optional=True)
    workload: tuple[Workload, ...] = ()
    families = get("moe.profile.workload.families", list, (str,), optional=True)
    if families is not None:
        columns = [get(f"moe.profile.workload.{k}", list, kinds) for k, kinds in
                   (("weights", (int, float)), ("requests", (int,)), ("decode_rows", (int,)))]
        if any(len(c) != len(families) for c in columns):
            raise fail("the moe.profile.workload arrays differ in length")
        workload = tuple(Workload(f, float(w), r, d) for f, w, r, d in zip(families, *columns))
    return ExpertProfile(identity, scores, counts, workload)


# ---- STRP ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StrpFile:
    n_layers: int
    n_expert: int
    slots: int
    ranked: tuple[tuple[int, int], ...]  # (layer, expert), hottest first

    def scores(self) -> np.ndarray:
        """Rank r of n scores (n - r) / n; unranked experts 0."""
        out = np.zeros((self.n_layers, self.n_expert))
        n = len(self.ranked)
        for r, (layer, expert) in enumerate(self.ranked):
            out[layer, expert] = (n - r) / n
        return out


def write_strp(profile: ExpertProfile, path: Path, slots: int | None = None) -> None:
    src = profile.identity
    if src.n_layer > MAX_STRP_DIM or src.n_expert > MAX_STRP_DIM:
        raise UserError(f"STRP holds at most {MAX_STRP_DIM} layers and experts; this profile has "
                        f"{src.n_layer} × {src.n_expert}")
    positive = int((profile.scores > 0).sum())
    ranked = profile.ranking()[:positive if slots is None else min(slots, positive)]
    ranks = np.full((src.n_layer, src.n_expert), -1, dtype="<i4")
    pairs = np.zeros((len(ranked), 2), dtype="<u2")
    for r, (layer, expert) in enumerate(ranked):
        ranks[layer, expert] = r
        pairs[r] = layer, expert
    header = _STRP_HEADER.pack(STRP_MAGIC, STRP_VERSION, src.n_layer, src.n_expert,
                               len(ranked) if slots is None else slots, len(ranked))
    with open(path, "wb") as f:
        f.write(header + pairs.tobytes() + ranks.tobytes())


def read_strp(path: str | os.PathLike[str]) -> StrpFile:
    path = Path(path)

    def fail(problem: str) -> UserError:
        return UserError(f"{path}: corrupt STRP profile: {problem}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_STRP_HEADER.size)
            if len(head) < _STRP_HEADER.size:
                raise fail(f"truncated: the header needs {_STRP_HEADER.size} bytes, the file has {size}")
            magic, version, n_layers, n_expert, slots, n_ranked = _STRP_HEADER.unpack(head)
            if magic != STRP_MAGIC:
                raise fail(f"starts with {magic!r}, not b'STRP'")
            if version != STRP_VERSION:
                raise fail(f"version {version} is not supported (this reader knows version {STRP_VERSION})")
            if not (1 <= n_layers <= MAX_STRP_DIM and 1 <= n_expert <= MAX_STRP_DIM):
                raise fail(f"{n_layers} layers × {n_expert} experts is out of range (1 to {MAX_STRP_DIM} each)")
            if n_ranked > slots:
                raise fail(f"ranks {n_ranked} experts for a cache of {slots} slots (n_ranked must not exceed slots)")
            if n_ranked > n_layers * n_expert:
                raise fail(f"ranks {n_ranked} experts, but {n_layers} layers × {n_expert} experts "
                           f"are only {n_layers * n_expert}")
            # Checked before reading, so a corrupt count cannot make us read gigabytes.
            expected = _STRP_HEADER.size + 4 * n_ranked + 4 * n_layers * n_expert
            if size != expected:
                what = "truncated" if size < expected else f"{size - expected} unexpected bytes at the end"
                raise fail(f"{what}: {n_ranked} ranked entries and a {n_layers} × {n_expert} table make "
                           f"{expected} bytes, the file has {size}")
            body = f.read(4 * n_ranked)
    except OSError as e:
        raise UserError(f"cannot read profile {path}: {e.strerror}") from None
    pairs = np.frombuffer(body, dtype="<u2").reshape(-1, 2)
    ranked = tuple((int(layer), int(expert)) for layer, expert in pairs)
    seen: set[tuple[int, int]] = set()
    for r, (layer, expert) in enumerate(ranked):
        if layer >= n_layers or expert >= n_expert:
            raise fail(f"entry {r} names layer {layer}, expert {expert}, "
                       f"outside {n_layers} layers × {n_expert} experts")
        if (layer, expert) in seen:
            raise fail(f"layer {layer}, expert {expert} is ranked twice")
        seen.add((layer, expert))
    return StrpFile(n_layers, n_expert, slots, ranked)


# ---- the corpus ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class CorpusRequest:
    family: str
    max_tokens: int
    prompt: str | None = None
    messages: list[dict] | None = None


@dataclass(frozen=True)
class Corpus:
    weights: dict[str, float]  # normalized to sum 1
    requests: tuple[CorpusRequest, ...]


def load_corpus(path: str | os.PathLike[str]) -> Corpus:
    """Reads and checks a corpus file; every problem is a UserError that names it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read corpus {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"corpus {path} is not valid JSON: {e}") from None
    if not text.strip():
        raise UserError(f"corpus {path} is empty: it must be a JSON object with version, weights and requests")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise UserError(f"corpus {path} is not a corpus: its JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and integers past Python's digit limit
        raise UserError(f"corpus {path} is not valid JSON: {e}") from None
    return parse_corpus(doc, path.parent, str(path))


def parse_corpus(doc: object, base: Path, name: str = "corpus") -> Corpus:
    """`doc` as a corpus; prompt_file paths are relative to `base`."""
    def fail(problem: str) -> UserError:
        return UserError(f"{name}: {problem}")

    if not isinstance(doc, dict):
        raise fail("must be a JSON object with version, weights and requests")
    unknown = set(doc) - {"version", "weights", "requests"}
    if unknown:
        raise fail(f"unknown key {sorted(unknown)[0]!r} (expected version, weights, requests)")
    if doc.get("version") != 1 or isinstance(doc.get("version"), bool):
        raise fail(f"version must be 1, not {doc.get('version')!r}")
    weights = doc.get("weights")
    if not isinstance(weights, dict) or not weights:
        raise fail('"weights" must map each family to a positive number, e.g. {"chat": 1}')
    for family, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise fail(f"the weight of family {family!r} must be a positive number, not {w!r}")
    requests = doc.get("requests")
    if not isinstance(requests, list) or not requests:
        raise fail('"requests" must be a non-empty list')
    if len(requests) > MAX_REQUESTS:
        raise fail(f"{len(requests)} requests is too many (at most {MAX_REQUESTS})")
    parsed = tuple(_parse_request(r, i, weights, base, fail) for i, r in enumerate(requests))
    idle = sorted(set(weights) - {r.family for r in parsed})
    if idle:
        raise fail(f"family {idle[0]!r} has a weight but no requests")
    total = float(sum(weights.values()))
    return Corpus({f: w / total for f, w in weights.items()}, parsed)


def _parse_request(r: object, i: int, weights: dict, base: Path, fail: Callable[[str], UserError]) -> CorpusRequest:
    where = f"request #{i + 1}"
    if not isinstance(r, dict):
        raise fail(f"{where} must be an object")
    unknown = set(r) - {"family", "prompt", "prompt_file", "messages", "max_tokens"}
    if unknown:
        raise fail(f"{where}: unknown key {sorted(unknown)[0]!r}")
    family = r.get("family")
    if not isinstance(family, str) or family not in weights:
        raise fail(f"{where}: family {family!r} has no weight in \"weights\"")
    max_tokens = r.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS:
        raise fail(f"{where}: max_tokens must be a whole number from 1 to {MAX_TOKENS}, not {max_tokens!r}")
    given = [k for k in ("prompt", "prompt_file", "messages") if k in r]
    if len(given) != 1:
        raise fail(f"{where} needs exactly one of prompt, prompt_file, messages (has {', '.join(given) or 'none'})")
    if "messages" in r:
        messages = r["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise fail(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}} strings")
        if not any(m["content"].strip() for m in messages):
            raise fail(f"{where}: empty prompt (every message is blank)")
        return CorpusRequest(family, max_tokens, messages=messages)
    if "prompt_file" in r:
        if not isinstance(r["prompt_file"], str) or "\0" in r["prompt_file"]:
            raise fail(f"{where}: prompt_file must be a path")
        file = base / r["prompt_file"]
        try:
            prompt = file.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            raise fail(f"{where}: prompt file {file} does not exist") from None
        except OSError as e:
            raise fail(f"{where}: cannot read prompt file {file}: {e.strerror}") from None
    else:
        prompt = r["prompt"]
        if not isinstance(prompt, str):
            raise fail(f"{where}: prompt must be a string")
    if not prompt.strip():
        raise fail(f"{where}: empty prompt")
    return CorpusRequest(family, max_tokens, prompt=prompt)

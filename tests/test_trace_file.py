"""Trace files (tracefile.py, properties/recorded.py): the writer keeps every value bit for bit, and a bad
file is a contract breach that names the file and the node, never a traceback; the nodes that can still
be judged are judged, and the judge exits 6."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import serialize_file
from safetensors.numpy import TensorSpec

from gemma4_conformance import tracefile
from gemma4_conformance.adapters import numpy_backend
from gemma4_conformance.adapters.contract import ContractViolation
from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.composition.graph import AdapterOps, TraceRecorder, composed
from gemma4_conformance.properties import recorded
from gemma4_conformance.properties.trace import INPUTS_NOT_TRACED, NOT_TRACED, PASSED, completed
from gemma4_conformance.spec.model import decoder_layer

LAYERS, TOKENS = 2, 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-layer cut of the generated checkpoint and the numpy backend's bf16 run on it: (weights, tokens,
    every node's value)."""
    config = generate.small_config()
    config.update(num_hidden_layers=LAYERS, layer_types=config["layer_types"][:LAYERS])
    weights = checkpoint.load(generate.write_checkpoint(tmp_path_factory.mktemp("trace-file"), config))
    tokens = np.random.default_rng(0).integers(0, weights.config.vocab_size, TOKENS)
    out = composed(numpy_backend, weights.config, weights, tokens, "bfloat16", trace=True)
    return weights, tokens, completed(out["trace"], out, weights.config)


def write(path, run, nodes=None, **metadata):
    weights, tokens, trace = run
    meta = dict(engine="numpy", dtype="bfloat16", checkpoint=str(weights.path),
                checkpoint_sha256=recorded.checkpoint_sha256(weights)) | metadata
    return tracefile.write(path, tokens=tokens, nodes=trace if nodes is None else nodes, **meta)


def resave(source, target, drop=(), metadata=None, remove=()):
    """``source``'s tensors and metadata, less the tensors ``drop`` and the keys ``remove``, with
    ``metadata`` changed, as another file."""
    found = tracefile.read(source)
    arrays = {name: np.ascontiguousarray(a) for name, a in found.tensors.items() if name not in drop}
    specs = {name: TensorSpec(dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
             for name, a in arrays.items()}
    meta = {k: v for k, v in (found.metadata | (metadata or {})).items() if k not in remove}
    serialize_file(specs, str(target), metadata=meta)
    return target


def test_the_writer_keeps_every_node_bit_for_bit_and_the_safetensors_library_reads_the_file(tmp_path, run):
    weights, tokens, trace = run
    path = write(tmp_path / "t.safetensors", run, engine_version="1.2", device="cuda:0")
    found = tracefile.read(path)
    assert found.metadata == {"format": tracefile.FORMAT, "format_version": tracefile.VERSION, "engine": "numpy",
                               "engine_version": "1.2", "dtype": "bfloat16", "device": "cuda:0",
                               "checkpoint": str(weights.path),
                               "checkpoint_sha256": recorded.checkpoint_sha256(weights)}
    assert not found.problems and set(found.tensors) == {*trace, "tokens", "positions"}
    for node, value in trace.items():
        assert found.tensors[node].dtype == value.dtype
        assert found.tensors[node].tobytes() == np.ascontiguousarray(value).tobytes(), node
    np.testing.assert_array_equal(found.tensors["positions"], np.arange(TOKENS))
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:  # the library's own reader (it has no bf16 in numpy)
        np.testing.assert_array_equal(f.get_tensor("tokens"), tokens)
    loaded = recorded.load(path, weights)
    assert not loaded.breaches and set(loaded.trace) == set(trace)


def breaches(path, weights) -> dict:
    return recorded.load(path, weights).breaches


def test_each_bad_node_is_a_breach_naming_the_file_and_the_node_and_the_rest_is_kept(tmp_path, run):
    weights, tokens, trace = run
    bad = dict(trace)
    bad["layers.0.q_projection"] = trace["layers.0.q_proj"]  # no such node
    bad["layers.0.q_proj"] = trace["layers.0.q_proj"][:-1]  # a token's row short
    nan = np.asarray(trace["layers.0.k_norm"], dtype=np.float32).copy()
    nan[3, 1, 5] = np.nan
    bad["layers.0.k_norm"] = nan.astype(trace["layers.0.k_norm"].dtype)
    bad["layers.1.o_proj"] = np.asarray(trace["layers.1.o_proj"], dtype=np.float32).astype(np.float16)  # < bf16
    path = write(tmp_path / "bad.safetensors", run, bad)
    found = recorded.load(path, weights)
    assert set(found.breaches) == {"layers.0.q_projection", "layers.0.q_proj", "layers.0.k_norm", "layers.1.o_proj"}
    assert all(str(path) in m and f"'{node}'" in m for node, m in found.breaches.items())
    assert "is not a node of the graph" in found.breaches["layers.0.q_projection"]
    assert f"has {(TOKENS - 1) * trace['layers.0.q_proj'].shape[-1]} values" in found.breaches["layers.0.q_proj"]
    assert "NaN at [3, 1, 5]" in found.breaches["layers.0.k_norm"]
    assert "float16, narrower than the declared dtype bfloat16" in found.breaches["layers.1.o_proj"]
    assert set(found.trace) == set(trace) - {"layers.0.q_proj", "layers.0.k_norm", "layers.1.o_proj"}


def test_metadata_that_disagrees_with_the_checkpoint_is_a_breach(tmp_path, run):
    weights = run[0]
    path = write(tmp_path / "t.safetensors", run, checkpoint_sha256="0" * 64)
    (message,) = breaches(path, weights).values()
    assert str(path) in message and "checkpoint_sha256" in message and "other weights" in message
    no_engine = resave(write(tmp_path / "u.safetensors", run), tmp_path / "v.safetensors", remove=("engine",))
    assert list(breaches(no_engine, weights)) == ["metadata engine"]
    unnamed = resave(no_engine, tmp_path / "w.safetensors", remove=tracefile.CHECKPOINT_KEYS, metadata={"engine": "e"})
    assert list(breaches(unnamed, weights)) == ["metadata checkpoint"]


@pytest.mark.parametrize("what, change, message", [
    ("no token ids", dict(drop=("tokens",)), "tensor 'tokens' (the prompt's token ids, I64 [T]) is missing"),
    ("an unknown dtype", dict(metadata={"dtype": "float8"}), "metadata dtype 'float8' is not one of"),
    ("another format", dict(metadata={"format_version": "9"}), "version '9'; this suite reads"),
])
def test_a_file_that_cannot_be_judged_at_all_says_why(tmp_path, run, what, change, message):
    path = resave(write(tmp_path / "t.safetensors", run), tmp_path / "bad.safetensors", **change)
    with pytest.raises(ContractViolation, match=r"bad\.safetensors") as e:
        recorded.load(path, run[0])
    assert message in str(e.value), what


def test_declared_formats_in_the_metadata_are_read_or_refused_naming_the_file(tmp_path, run):
    """``formats`` (optional): read as a backend's bracket options; any other text is a ContractViolation naming
    the file and the key, never another exception (Hypothesis: drawn text and near-valid items)."""
    path = write(tmp_path / "t.safetensors", run)
    target = tmp_path / "formats.safetensors"
    assert recorded.load(path, run[0]).formats == {}
    resave(path, target, metadata={"formats": "activations=q8_0, kv_cache=fp8_e4m3@1.5:0.75"})
    assert recorded.load(target, run[0]).formats == {"activations": "q8_0", "kv_cache": "fp8_e4m3@1.5:0.75"}
    seen = set()
    item = st.sampled_from(["activations=q8_0", "kv_cache=fp8_e5m2@2", "kv_cache=fp8_e4m3@0", "activations",
                            "=q8_0", "weights=q4_k", "kv=f16", "kv_cache=fp8_e4m3@1:2:3", ",", " "])

    @settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.text(max_size=24), st.lists(item, max_size=4).map(",".join)))
    def fuzz(text):
        resave(path, target, metadata={"formats": text})
        try:
            formats = recorded.load(target, run[0]).formats
        except ContractViolation as e:
            assert str(target) in str(e) and "formats" in str(e)
            seen.add("refused")
            return
        assert isinstance(formats, dict)
        seen.add("read")

    fuzz()
    assert seen == {"refused", "read"}


def test_a_truncated_file_is_a_breach_of_the_tensors_it_cuts(tmp_path, run):
    weights = run[0]
    path = write(tmp_path / "t.safetensors", run)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    (tmp_path / "cut.safetensors").write_bytes(data[:-1])
    found = recorded.load(tmp_path / "cut.safetensors", weights)
    assert list(found.breaches) == [last] and "truncated" in found.breaches[last]
    (tmp_path / "head.safetensors").write_bytes(data[:8 + n // 2])
    with pytest.raises(ContractViolation, match=r"head\.safetensors: truncated"):
        recorded.load(tmp_path / "head.safetensors", weights)


def test_the_judge_judges_what_it_can_writes_the_report_and_exits_6(tmp_path, run):
    """A file with a NaN node and an unknown one: the other nodes are judged (the NaN node's consumers have
    no inputs to be judged on), both breaches are named in the report's problems, and the exit is 6."""
    weights, tokens, trace = run
    nodes = {node: value for node, value in trace.items() if node == "embed" or node.startswith("layers.0.")}
    nan = np.asarray(nodes["layers.0.q_norm"], dtype=np.float32).copy()
    nan[0, 0, 0] = np.nan
    nodes |= {"layers.0.q_norm": nan.astype(nodes["layers.0.q_norm"].dtype), "layers.0.qk_norm": nan}
    path = write(tmp_path / "bad.safetensors", run, nodes)
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "gemma4_conformance", "judge", str(path), f"--weights={weights.path}",
                           f"--report-json={report}", f"--report-html={tmp_path / 'report.html'}"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 6, done.stdout + done.stderr
    doc = json.loads(report.read_text())
    assert (tmp_path / "report.html").exists()
    messages = " ".join(p["message"] for p in doc["problems"])
    assert "'layers.0.q_norm' is NaN" in messages and "'layers.0.qk_norm' is not a node" in messages
    assert str(path) in messages
    (entry,) = doc["traces"]
    got = {n["node"]: n for n in entry["nodes"]}
    assert got["layers.0.q_norm"]["outcome"] == NOT_TRACED and "NaN" in got["layers.0.q_norm"]["message"]
    assert got["layers.0.q_rope"]["outcome"] == INPUTS_NOT_TRACED
    judged = [n for n, v in got.items() if v["outcome"] == PASSED]
    assert len(judged) == len(nodes) - 3 and "layers.0.k_rope" in judged  # all but the two breaches and q_rope


# The fuzz test: whatever the bytes, the reader and the checks give their contract messages only.

def _forged_entry():
    """An entry whose fields are each often well-formed (so that every check is reached on its own) and
    otherwise wrong in any way."""
    shape = st.lists(st.integers(0, 40), max_size=3)
    offsets = st.lists(st.integers(0, 1 << 12), min_size=2, max_size=2)
    return st.fixed_dictionaries({
        "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "F64", "U8", "X", 3]),
        "shape": st.one_of(shape, shape, st.lists(st.one_of(st.integers(-2, 40), st.just("3"), st.none()), max_size=3),
                           st.integers()),
        "data_offsets": st.one_of(offsets, offsets, st.lists(st.integers(-8, 1 << 20), max_size=3),
                                  st.text(max_size=3)),
    })


@st.composite
def mangled(draw, original: bytes):
    (n,) = struct.unpack("<Q", original[:8])
    header, data = json.loads(original[8:8 + n]), bytearray(original[8 + n:])
    kind = draw(st.sampled_from(["truncate", "flip", "forge", "offsets", "dtype", "length", "json"]))
    if kind == "json":  # a header that is JSON but no object
        header = draw(st.one_of(st.none(), st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=3)))
    elif kind == "forge":  # entries and metadata made up, over the real data
        names = st.sampled_from([*header, "layers.0.q_proj", "layers.9.q_proj", "nonsense", ""])
        header = draw(st.dictionaries(names, _forged_entry(), max_size=6))
        header["__metadata__"] = draw(st.one_of(st.none(), st.just(json.loads(original[8:8 + n])["__metadata__"]),
                                                st.dictionaries(st.text(max_size=8), st.text(max_size=8))))
    elif kind in ("offsets", "dtype"):  # one real entry's shape or data_offsets moved, or its dtype changed
        name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        if kind == "dtype":
            header[name]["dtype"] = draw(st.sampled_from(["U8", "X", 3, None, "F32", "BF16", "F16", "I32"]))
        else:
            key = draw(st.sampled_from(["shape", "data_offsets"]))
            header[name][key] = [x + draw(st.integers(-64, 64)) for x in header[name][key]]
    raw = json.dumps(header).encode()
    blob = bytearray(struct.pack("<Q", len(raw)) + raw + bytes(data)) if kind in ("forge", "offsets", "dtype", "json") \
        else bytearray(original)
    if kind == "length":
        blob[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            blob[draw(st.integers(0, len(blob) - 1))] ^= draw(st.integers(1, 255))
    if kind == "truncate":
        blob = blob[:draw(st.integers(0, len(blob) - 1))]
    return bytes(blob)


def test_the_reader_gives_only_contract_messages_whatever_the_bytes(tmp_path, run):
    weights, _, trace = run
    small = {node: value for node, value in trace.items() if node == "embed" or node.startswith("layers.0.")}
    original = write(tmp_path / "t.safetensors", run, small).read_bytes()
    target = tmp_path / "fuzzed.safetensors"
    seen = set()

    @settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    @given(blob=mangled(original))
    def fuzz(blob):
        target.write_bytes(blob)
        try:
            found = recorded.load(target, weights)
        except ContractViolation as e:
            assert str(target) in str(e)
            seen.add("unreadable")
            return
        assert all(str(target) in m for m in found.breaches.values())
        seen.add("breached" if found.breaches else "clean")

    fuzz()
    assert seen == {"unreadable", "breached", "clean"}  # the mangling reached all three outcomes


def test_one_layer_of_the_12b_geometry_is_judged_without_the_models_weights_in_memory(tmp_path):
    """A trace of layer 0 of the real geometry (a layout-only checkpoint: 24 GB of holes) is judged under a
    4 GiB limit on its data (read-only maps of the checkpoint aside): the replay holds the judged layer's
    weights, not a copy of every layer's."""
    folder = generate.write_checkpoint(tmp_path / "12b", generate.real_config(), shards=5, layout_only=True)
    weights = checkpoint.load(folder)
    config = weights.config
    tokens = np.arange(4)
    ops = AdapterOps(numpy_backend, "bfloat16", observe=TraceRecorder())
    x = ops.op("embed", "embed", config.embed_scale, ops.weight(weights["model.embed_tokens.weight"][tokens]),
               np.arange(4))
    decoder_layer(ops, config, weights, config.layers[0], x, np.arange(4))
    path = tracefile.write(tmp_path / "layer0.safetensors", tokens=tokens, nodes=ops.observe.trace, engine="numpy",
                           dtype="bfloat16", checkpoint=str(folder))
    limit = "import resource; resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30)); "
    done = subprocess.run([sys.executable, "-c", limit + "from gemma4_conformance.__main__ import main; "
                           f"raise SystemExit(main(['judge', {str(path)!r}, '--weights={folder}', '--report-html=', "
                           f"'--report-json=report.json', '-k', 'nodes']))"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (entry,) = json.loads((tmp_path / "report.json").read_text())["traces"]
    assert entry["summary"].startswith("no node departs (21 judged)")

"""checkpoints.config, checkpoints.checkpoint and checkpoints.generate: reading both config forms, refusing the
features Gemma 4 12B does not use, writing checkpoints in the real layout, loading them lazily, and a
clear error for every way a checkpoint can be broken."""

from __future__ import annotations

import copy
import json
import math
import mmap
import os
import shutil
import struct
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gemma4_conformance.checkpoints import generate
from gemma4_conformance.checkpoints.checkpoint import (
    INDEX_NAME,
    MULTIMODAL_PREFIX,
    SINGLE_NAME,
    TEXT_PREFIX,
    Checkpoint,
    CheckpointError,
    expected_shapes,
    load,
)
from gemma4_conformance.checkpoints.config import ConfigError, LayerSpec, TextConfig

FIXTURE_CONFIG = Path(generate.__file__).resolve().parent / "gemma-4-12B" / "config.json"
SHARED_CONFIG = Path("/work/shared/gemma-4-12B/config.json")
NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
             "float32": np.dtype(np.float32)}
MM = MULTIMODAL_PREFIX


# ---- config ----------------------------------------------------------------------------------------

def test_fixture_config_is_the_real_text_config():
    doc = json.loads(FIXTURE_CONFIG.read_text())
    assert doc["model_type"] == "gemma4_unified_text" and doc["hidden_size"] == 3840
    if SHARED_CONFIG.is_file():
        assert FIXTURE_CONFIG.read_bytes() == SHARED_CONFIG.read_bytes()


def test_real_config_reads_with_the_facts_sheet_values():
    cfg = TextConfig.from_file(FIXTURE_CONFIG.parent)     # a folder holding config.json
    assert cfg == TextConfig.from_file(FIXTURE_CONFIG)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (262144, 3840, 15360)
    assert (cfg.num_layers, cfg.num_heads) == (48, 16)
    assert cfg.eps == 1e-6 and cfg.final_softcap == 30.0
    assert cfg.embed_scale == pytest.approx(61.967733539318672)
    assert cfg.tie_embeddings is True and cfg.activation == "gelu_pytorch_tanh"
    assert cfg.full_layers == tuple(range(5, 48, 6))
    assert [s.index for s in cfg.layers] == list(range(48))
    for s in cfg.layers:
        if s.index % 6 == 5:
            assert s == LayerSpec(index=s.index, kind="full", head_dim=512, kv_heads=1, k_eq_v=True,
                                  rope_theta=1e6, rope_rot=512, rope_denom=512, rope_active=64, window=None)
        else:
            assert s == LayerSpec(index=s.index, kind="sliding", head_dim=256, kv_heads=8, k_eq_v=False,
                                  rope_theta=1e4, rope_rot=256, rope_denom=256, rope_active=128, window=1024)
    assert cfg.raw == json.loads(FIXTURE_CONFIG.read_text())


def test_real_layout_matches_the_facts_sheet():
    cfg = TextConfig.from_dict(generate.real_config())
    shapes = expected_shapes(cfg)
    sliding, full = "model.layers.0.", "model.layers.5."
    assert shapes["model.embed_tokens.weight"] == (262144, 3840)
    assert shapes["model.norm.weight"] == (3840,)
    assert shapes[sliding + "self_attn.q_proj.weight"] == (4096, 3840)
    assert shapes[full + "self_attn.q_proj.weight"] == (8192, 3840)
    assert shapes[sliding + "self_attn.k_proj.weight"] == (2048, 3840)
    assert shapes[full + "self_attn.k_proj.weight"] == (512, 3840)
    assert shapes[sliding + "self_attn.v_proj.weight"] == (2048, 3840)
    assert full + "self_attn.v_proj.weight" not in shapes
    assert shapes[sliding + "self_attn.o_proj.weight"] == (3840, 4096)
    assert shapes[full + "self_attn.o_proj.weight"] == (3840, 8192)
    assert shapes[sliding + "self_attn.q_norm.weight"] == shapes[sliding + "self_attn.k_norm.weight"] == (256,)
    assert shapes[full + "self_attn.k_norm.weight"] == (512,)
    assert shapes[full + "mlp.gate_proj.weight"] == shapes[full + "mlp.up_proj.weight"] == (15360, 3840)
    assert shapes[full + "mlp.down_proj.weight"] == (3840, 15360)
    assert shapes[full + "layer_scalar"] == (1,)
    assert "lm_head.weight" not in shapes
    # the facts sheet's 11,907,350,272 text parameters (layer scalars not counted)
    assert sum(math.prod(v) for k, v in shapes.items() if not k.endswith("layer_scalar")) == 11_907_350_272


def transformers5_form(d: dict) -> dict:
    """The hub-form dict rewritten by hand the way transformers 5 save_pretrained writes it."""
    d = copy.deepcopy(d)
    head_dim, kv = d.pop("global_head_dim"), d.pop("num_global_key_value_heads")
    d["per_layer_config"] = {f"{i:02d}": {"head_dim": head_dim, "num_key_value_heads": kv}
                             for i, t in enumerate(d["layer_types"]) if t == "full_attention"}
    d["dtype"] = d.pop("torch_dtype")
    return d


@pytest.mark.parametrize("make", [generate.small_config, generate.real_config])
def test_both_config_forms_give_the_same_config(make):
    hub = make()
    cfg = TextConfig.from_dict(hub)
    t5 = transformers5_form(hub)
    assert "global_head_dim" not in t5 and "torch_dtype" not in t5 and "05" in t5["per_layer_config"]
    assert TextConfig.from_dict(t5) == cfg
    assert TextConfig.from_dict(t5).raw == t5 and cfg.raw == hub
    # the generator's own conversion, both ways
    assert TextConfig.from_dict(generate.config_in_form(hub, "transformers5")) == cfg
    assert TextConfig.from_dict(generate.config_in_form(t5, "hub")) == cfg
    # a per_layer_config that lists every layer, sliding ones included
    every = copy.deepcopy(t5)
    for i, t in enumerate(every["layer_types"]):
        every["per_layer_config"].setdefault(
            f"{i:02d}", {"head_dim": every["head_dim"], "num_key_value_heads": every["num_key_value_heads"]})
    assert TextConfig.from_dict(every) == cfg
    # multimodal wrappers, either form
    assert TextConfig.from_dict({"model_type": "gemma4", "text_config": hub, "vision_config": {}}) == cfg
    assert TextConfig.from_dict({"text_config": t5, "tie_word_embeddings": True, "dtype": "bfloat16"}) == cfg


def test_small_config_keeps_every_feature_of_the_real_one():
    cfg = TextConfig.from_dict(generate.small_config())
    real = TextConfig.from_dict(generate.real_config())
    assert cfg.num_layers == 48 and cfg.num_heads == 16
    assert cfg.full_layers == real.full_layers == tuple(range(5, 48, 6))
    sliding, full = cfg.layers[0], cfg.layers[5]
    # head dims that engines' CPU attention kernels take (vLLM's refuses 16), the full ones twice the sliding
    assert (sliding.head_dim, sliding.kv_heads, sliding.k_eq_v) == (32, 8, False)
    assert (full.head_dim, full.kv_heads, full.k_eq_v) == (64, 1, True)
    assert (sliding.rope_theta, sliding.rope_active, sliding.rope_rot, sliding.rope_denom) == (1e4, 16, 32, 32)
    assert (full.rope_theta, full.rope_active, full.rope_rot, full.rope_denom) == (1e6, 8, 64, 64)
    assert sliding.window == 8 and full.window is None
    assert (cfg.final_softcap, cfg.eps, cfg.activation, cfg.tie_embeddings) == (30.0, 1e-6, "gelu_pytorch_tanh", True)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (64, 128, 512)


def test_null_final_softcap_is_none():
    d = generate.small_config()
    d["final_logit_softcapping"] = None
    assert TextConfig.from_dict(d).final_softcap is None


def edit(d: dict, path: str, value=None, delete=False) -> dict:
    """d with path ("a.b.0.c") set to value, or deleted."""
    d = copy.deepcopy(d)
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = int(keys[-1]) if isinstance(node, list) else keys[-1]
    if delete:
        del node[last]
    else:
        node[last] = value
    return d


REFUSED = [  # (field, value, what the message names)
    ("hidden_size_per_layer_input", 256, ("hidden_size_per_layer_input", "per-layer embeddings")),
    ("enable_moe_block", True, ("enable_moe_block", "mixture-of-experts")),
    ("num_kv_shared_layers", 20, ("num_kv_shared_layers", "KV sharing")),
    ("use_double_wide_mlp", True, ("use_double_wide_mlp", "double-wide MLP")),
    ("use_bidirectional_attention", True, ("use_bidirectional_attention", "bidirectional")),
    ("layer_types.3", "bidirectional_attention", ("layer_types[3]", "bidirectional_attention")),
    ("layer_types.4", "chunked_attention", ("layer_types[4]", "chunked_attention")),
    ("attention_bias", True, ("attention_bias", "biases")),
    ("attn_logit_softcapping", 50.0, ("attn_logit_softcapping", "softcapping")),
    ("tie_word_embeddings", False, ("tie_word_embeddings", "untied embeddings")),
    ("hidden_activation", "silu", ("hidden_activation", "'silu'")),
    ("rope_parameters.full_attention.rope_type", "yarn", ("rope_parameters.full_attention.rope_type", "'yarn'")),
    ("rope_parameters.sliding_attention.rope_type", "linear", ("rope_parameters.sliding_attention.rope_type", "linear")),
    ("rope_parameters.full_attention.factor", 8.0, ("rope_parameters.full_attention.factor", "not supported")),
    ("rope_parameters.sliding_attention.partial_rotary_factor", 0.5,
     ("rope_parameters.sliding_attention.partial_rotary_factor", "partial rotation")),
    ("rope_scaling", {"rope_type": "linear", "factor": 8.0}, ("rope_scaling", "not supported")),
]


@pytest.mark.parametrize("field,value,says", REFUSED, ids=[r[0] for r in REFUSED])
def test_unused_features_are_refused_naming_the_field(field, value, says):
    d = edit(generate.small_config(), field, value)
    with pytest.raises(ConfigError) as e:
        TextConfig.from_dict(d, source="some/config.json")
    message = str(e.value)
    assert message.startswith("some/config.json: ")
    for part in says:
        assert part in message
    assert isinstance(e.value, ValueError)


def test_untied_embeddings_in_the_multimodal_wrapper_are_refused():
    text = edit(generate.small_config(), "tie_word_embeddings", delete=True)
    with pytest.raises(ConfigError, match=r"cfg\.json: tie_word_embeddings: false: untied"):
        TextConfig.from_dict({"text_config": text, "tie_word_embeddings": False}, "cfg.json")
    with pytest.raises(ConfigError, match=r"text_config\.tie_word_embeddings: True contradicts the top-level"):
        TextConfig.from_dict({"text_config": generate.small_config(), "tie_word_embeddings": False}, "cfg.json")
    with pytest.raises(ConfigError, match=r"text_config\.tie_word_embeddings: false"):
        TextConfig.from_dict({"text_config": edit(generate.small_config(), "tie_word_embeddings", False)}, "x")


INVALID = [  # (edit, path, value or DELETE, what the message names)
    ("missing vocab", "vocab_size", "DELETE", "vocab_size: missing"),
    ("string hidden", "hidden_size", "64", "hidden_size: must be an integer"),
    ("zero layers", "num_hidden_layers", 0, "num_hidden_layers: must be >= 1"),
    ("layer count", "num_hidden_layers", 47, "layer_types: has 48 entries but num_hidden_layers is 47"),
    ("kv heads", "num_key_value_heads", 3, "num_key_value_heads: layer 0: num_attention_heads 16 is not a multiple"),
    ("global kv heads", "num_global_key_value_heads", 5, "num_global_key_value_heads: layer 5"),
    ("odd head dim", "head_dim", 15, "head_dim: layer 0: head_dim 15 must be even"),
    ("odd global head dim", "global_head_dim", 33, "global_head_dim: layer 5"),
    ("eps", "rms_norm_eps", -1e-6, "rms_norm_eps: must be > 0"),
    ("eps type", "rms_norm_eps", "1e-6", "rms_norm_eps: must be a finite number"),
    ("softcap", "final_logit_softcapping", 0, "final_logit_softcapping: must be > 0"),
    ("softcap missing", "final_logit_softcapping", "DELETE", "final_logit_softcapping: missing"),
    ("window", "sliding_window", 0, "sliding_window: must be >= 1"),
    ("window missing", "sliding_window", None, "sliding_window: must be an integer"),
    ("theta", "rope_parameters.full_attention.rope_theta", -1.0, "rope_parameters.full_attention.rope_theta: must be > 0"),
    ("theta missing", "rope_parameters.sliding_attention.rope_theta", "DELETE",
     "rope_parameters.sliding_attention.rope_theta: missing"),
    ("factor missing", "rope_parameters.full_attention.partial_rotary_factor", "DELETE",
     "rope_parameters.full_attention.partial_rotary_factor: missing"),
    ("factor > 1", "rope_parameters.full_attention.partial_rotary_factor", 2.0,
     "rope_parameters.full_attention.partial_rotary_factor: must be in (0, 1]"),
    ("rope type entry", "rope_parameters.full_attention", "DELETE", "rope_parameters.full_attention: missing"),
    ("rope layer type", "rope_parameters.chunked_attention", {"rope_type": "default", "rope_theta": 1.0},
     "rope_parameters.chunked_attention: unknown layer type"),
    ("no rope", "rope_parameters", "DELETE", "rope_parameters: missing"),
    ("layer types", "layer_types", "sliding", "layer_types: must be a list"),
    ("k_eq_v", "attention_k_eq_v", "yes", "attention_k_eq_v: must be true or false"),
    ("global geometry", "global_head_dim", "DELETE", None),   # num_global_key_value_heads still there: fine
    ("dtype", "torch_dtype", "int8", "torch_dtype: 'int8' is not a supported dtype"),
    ("activation alias", "hidden_act", "gelu", "hidden_act: 'gelu' contradicts hidden_activation"),
]


@pytest.mark.parametrize("name,path,value,says", INVALID, ids=[r[0] for r in INVALID])
def test_invalid_fields_are_named(name, path, value, says):
    d = edit(generate.small_config(), path, delete=value == "DELETE", value=None if value == "DELETE" else value)
    if says is None:
        TextConfig.from_dict(d)
        return
    with pytest.raises(ConfigError) as e:
        TextConfig.from_dict(d, source="a/config.json")
    assert str(e.value).startswith("a/config.json: ") and says in str(e.value), str(e.value)


def test_full_layers_need_their_geometry():
    d = edit(edit(generate.small_config(), "global_head_dim", delete=True), "num_global_key_value_heads", delete=True)
    with pytest.raises(ConfigError, match="global_head_dim: missing: full-attention layers need"):
        TextConfig.from_dict(d)


@pytest.mark.parametrize("entries,says", [
    ({"xx": {"head_dim": 32}}, "per_layer_config.xx: keys must be layer indices"),
    ({"48": {"head_dim": 32}}, "per_layer_config.48: layer 48 does not exist"),
    ({"05": {"head_dim": 32}, "5": {"head_dim": 32}}, "per_layer_config.5: layer 5 is given twice"),
    ({"05": {"head_dim": 32, "sliding_window": 4}}, "per_layer_config.05.sliding_window: not supported"),
    ({"05": {"head_dim": "32"}}, "per_layer_config.05.head_dim: must be an integer"),
    ({"05": [32, 1]}, "per_layer_config.05: must be an object"),
    ({"05": {"head_dim": 32, "num_key_value_heads": 3}}, "per_layer_config.05.num_key_value_heads: layer 5"),
])
def test_per_layer_config_errors(entries, says):
    d = transformers5_form(generate.small_config())
    d["per_layer_config"] = entries
    with pytest.raises(ConfigError) as e:
        TextConfig.from_dict(d, "t5.json")
    assert says in str(e.value), str(e.value)


def test_contradicting_forms_are_refused():
    d = generate.small_config()
    d["per_layer_config"] = {"05": {"head_dim": 128, "num_key_value_heads": 1}}
    with pytest.raises(ConfigError, match="per_layer_config.05: .* contradicts global_head_dim 64"):
        TextConfig.from_dict(d)
    d = generate.small_config()
    d["dtype"] = "float16"
    with pytest.raises(ConfigError, match="dtype: contradictory values"):
        TextConfig.from_dict(d)


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}/config.json: config file not found"):
        TextConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"{tmp_path}/config.json: not valid JSON"):
        TextConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        TextConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(edit(generate.small_config(), "enable_moe_block", True)))
    with pytest.raises(ConfigError, match=f"{tmp_path}/config.json: enable_moe_block"):
        TextConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": edit(generate.small_config(), "head_dim", 15)}))
    with pytest.raises(ConfigError, match=f"{tmp_path}/config.json: text_config.head_dim"):
        TextConfig.from_file(tmp_path)


# ---- generating and loading --------------------------------------------------------------------------

def read_safetensors(file: Path):
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", None)
    data = raw[8 + n:]
    tensors = [(name, e["dtype"], e["shape"], data[e["data_offsets"][0]:e["data_offsets"][1]])
               for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])]
    return tensors, meta


def write_safetensors(file: Path, tensors, meta=None):
    header, offset = ({"__metadata__": meta} if meta else {}), 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(t[3] for t in tensors))


def check_against_generator(ck: Checkpoint, config: dict, seed: int, dtype: str):
    for name in ck:
        got = ck[name]
        want = generate.tensor_values(name, config, seed, dtype)
        assert got.dtype == NP_DTYPES[dtype] and got.shape == want.shape, name
        assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), name


LAYOUTS = [  # (prefix, shards, dtype, config form)
    (MM, 2, "bfloat16", "hub"),
    (MM, 1, "float16", "transformers5"),
    (MM, 5, "float32", "hub"),
    (TEXT_PREFIX, 1, "bfloat16", "transformers5"),
    (TEXT_PREFIX, 3, "float16", "hub"),
    (TEXT_PREFIX, 2, "float32", "transformers5"),
]


@pytest.mark.parametrize("prefix,shards,dtype,form", LAYOUTS)
def test_generated_checkpoint_loads_and_round_trips(tmp_path, prefix, shards, dtype, form):
    config = generate.small_config()
    folder = generate.write_checkpoint(tmp_path / "ck", config, seed=3, dtype=dtype, shards=shards,
                                       prefix=prefix, config_form=form)
    files = sorted(p.name for p in folder.iterdir())
    if shards == 1:
        assert files == ["config.json", SINGLE_NAME]
    else:
        assert files == ["config.json", *[f"model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1)],
                         INDEX_NAME]
        index = json.loads((folder / INDEX_NAME).read_text())
        assert all(name.startswith(prefix) for name in index["weight_map"])
        assert len(set(index["weight_map"].values())) == shards
    doc = json.loads((folder / "config.json").read_text())
    text = doc["text_config"] if prefix == MM else doc
    assert ("text_config" in doc) == (prefix == MM)
    if form == "hub":
        assert text["global_head_dim"] == 64 and text["torch_dtype"] == dtype and "per_layer_config" not in text
    else:
        assert text["per_layer_config"]["05"] == {"head_dim": 64, "num_key_value_heads": 1}
        assert sorted(text["per_layer_config"]) == [f"{i:02d}" for i in range(5, 48, 6)]
        assert text["dtype"] == dtype and "global_head_dim" not in text and "torch_dtype" not in text

    ck = load(folder)
    cfg = TextConfig.from_dict(config)
    assert ck.config == cfg and ck.path == folder and ck.prefix == prefix
    assert list(ck) == list(expected_shapes(cfg)) and len(ck) == 666
    assert ck.expected() == {k: (v,) for k, v in expected_shapes(cfg).items()}
    assert "model.layers.5.self_attn.v_proj.weight" not in ck and "model.layers.4.self_attn.v_proj.weight" in ck
    assert "lm_head.weight" not in ck
    assert ck.info("model.norm.weight").name == prefix + "norm.weight"
    w = ck["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(w, np.ndarray) and not w.flags.writeable
    with pytest.raises(KeyError):
        ck["lm_head.weight"]
    check_against_generator(ck, config, 3, dtype)


def test_generated_files_are_read_alike_by_the_safetensors_library(tmp_path):
    from safetensors.numpy import load_file
    for dtype in ("float16", "float32"):
        folder = generate.write_checkpoint(tmp_path / dtype, generate.small_config(), dtype=dtype, shards=2)
        ck = load(folder)
        theirs = {}
        for f in folder.glob("*.safetensors"):
            theirs.update(load_file(f))
        assert sorted(theirs) == sorted(ck.info(n).name for n in ck)
        for n in ck:
            np.testing.assert_array_equal(theirs[ck.info(n).name], ck[n])
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    folder = generate.write_checkpoint(tmp_path / "bf16", generate.small_config(), shards=2)
    ck = load(folder)
    for n in ck:
        info = ck.info(n)
        with safe_open(info.file, framework="pt") as f:
            t = f.get_tensor(info.name)
        assert t.dtype == torch.bfloat16
        np.testing.assert_array_equal(t.view(torch.int16).numpy(), ck[n].view(np.int16))


def test_generation_is_deterministic_and_seeded(tmp_path):
    a = generate.write_checkpoint(tmp_path / "a", generate.small_config(), seed=7, shards=2)
    b = generate.write_checkpoint(tmp_path / "b", generate.small_config(), seed=7, shards=2)
    c = generate.write_checkpoint(tmp_path / "c", generate.small_config(), seed=8, shards=2)
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes()
    assert (a / "model-00002-of-00002.safetensors").read_bytes() != (c / "model-00002-of-00002.safetensors").read_bytes()
    # rewriting a folder replaces the earlier files (a stale index would shadow a single file)
    generate.write_checkpoint(a, generate.small_config(), seed=7, shards=1)
    assert sorted(p.name for p in a.iterdir()) == ["config.json", SINGLE_NAME]
    with pytest.raises(ValueError, match="shards"):
        generate.write_checkpoint(tmp_path / "d", generate.small_config(), shards=0)
    with pytest.raises(ValueError, match="prefix"):
        generate.write_checkpoint(tmp_path / "d", generate.small_config(), prefix="language_model.")
    with pytest.raises(ValueError, match="dtype"):
        generate.write_checkpoint(tmp_path / "d", generate.small_config(), dtype="int8")


def test_small_checkpoint_values_are_in_the_designed_ranges(tmp_path):
    ck = load(generate.write_checkpoint(tmp_path / "ck", generate.small_config(), dtype="float32"))
    scalars = np.array([float(ck[f"model.layers.{i}.layer_scalar"][0]) for i in range(48)])
    assert scalars.min() == pytest.approx(0.005) and 0.85 <= np.delete(scalars, 23).min()
    assert scalars.max() <= 0.92
    for i in (0, 5):
        q = ck[f"model.layers.{i}.self_attn.q_norm.weight"]
        assert 0.2 < q.mean() < 0.7, "q/k norm weights keep attention logits O(1)"
    e = ck["model.embed_tokens.weight"] * np.float32(ck.config.embed_scale)
    assert 6 < np.sqrt(np.mean(e * e)) < 10
    assert np.all(ck["model.layers.0.input_layernorm.weight"] > 0)


def test_generation_streams_in_bounded_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(generate, "CHUNK", 1 << 16)
    config = dict(generate.small_config(), vocab_size=1 << 18)   # embeddings: 16 Mi values, 32 MB in bf16
    tracemalloc.start()
    try:
        generate.write_checkpoint(tmp_path / "ck", config, shards=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"writing held {peak / 2**20:.1f} MB at once"
    ck = load(tmp_path / "ck")
    np.testing.assert_array_equal(ck["model.embed_tokens.weight"][-3:].view(np.uint16),
                                  generate.tensor_values("model.embed_tokens.weight", config)[-3:].view(np.uint16))


def sparse_files_supported(folder: Path) -> bool:
    probe = folder / "probe"
    with open(probe, "wb") as f:
        f.truncate(64 << 20)
    sparse = os.stat(probe).st_blocks * 512 < (1 << 20)
    probe.unlink()
    return sparse


def test_loading_reads_headers_only_on_the_real_geometry(tmp_path):
    if not hasattr(os.stat_result, "st_blocks") or not sparse_files_supported(tmp_path):
        pytest.skip("no sparse files here")
    folder = generate.write_checkpoint(tmp_path / "real", generate.real_config(), shards=5, layout_only=True)
    assert sum(os.stat(f).st_blocks for f in folder.glob("*.safetensors")) * 512 < 16 << 20
    assert sum(f.stat().st_size for f in folder.glob("*.safetensors")) > 23.8e9
    tracemalloc.start()
    try:
        start = time.perf_counter()
        ck = load(folder)
        took = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert took < 2 and peak < 8 << 20
    assert ck.config == TextConfig.from_dict(generate.real_config()) and len(ck) == 666
    assert not any(isinstance(v, (np.ndarray, mmap.mmap)) for v in vars(ck).values())
    embed = ck["model.embed_tokens.weight"]     # 2 GB, mapped, not read
    assert embed.shape == (262144, 3840) and embed.dtype == NP_DTYPES["bfloat16"]
    assert float(embed[123456, 7]) == 0.0
    assert ck["model.layers.47.mlp.down_proj.weight"].shape == (3840, 15360)


def test_a_tensor_is_mapped_on_access_and_unmapped_when_dropped(tmp_path):
    ck = load(generate.write_checkpoint(tmp_path / "ck", generate.small_config()))
    norm = ck["model.norm.weight"]
    mapping = norm.base
    while not isinstance(mapping, mmap.mmap):
        mapping = mapping.base if isinstance(mapping, np.ndarray) else mapping.obj
    assert len(mapping) < 64 * 1024 + norm.nbytes  # this tensor's bytes, not the file's
    assert not any(isinstance(v, (np.ndarray, mmap.mmap)) for v in vars(ck).values())


# ---- broken checkpoints ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("pristine")
    return {
        "sharded": generate.write_checkpoint(base / "sharded", generate.small_config(), shards=2),
        "single": generate.write_checkpoint(base / "single", generate.small_config(), shards=1, prefix=TEXT_PREFIX),
    }


@pytest.fixture
def sharded(pristine, tmp_path):
    return Path(shutil.copytree(pristine["sharded"], tmp_path / "sharded"))


@pytest.fixture
def single(pristine, tmp_path):
    return Path(shutil.copytree(pristine["single"], tmp_path / "single"))


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"][name]


def edit_shard(file: Path, fn):
    tensors, meta = read_safetensors(file)
    write_safetensors(file, fn(tensors), meta)


def edit_index(folder: Path, fn):
    doc = json.loads((folder / INDEX_NAME).read_text())
    fn(doc["weight_map"])
    (folder / INDEX_NAME).write_text(json.dumps(doc))


def fails(folder: Path, *parts: str):
    with pytest.raises(CheckpointError) as e:
        load(folder)
    for part in parts:
        assert part in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)
    return str(e.value)


def test_pristine_copies_load(sharded, single):
    load(sharded)
    load(single)


def test_missing_tensor(sharded, single):
    name = MM + "layers.7.mlp.up_proj.weight"
    file = shard_of(sharded, name)
    edit_shard(file, lambda ts: [t for t in ts if t[0] != name])
    edit_index(sharded, lambda wm: wm.pop(name))
    assert "missing" in fails(sharded, name, str(sharded / INDEX_NAME))
    name = "model.layers.0.self_attn.v_proj.weight"
    edit_shard(single / SINGLE_NAME, lambda ts: [t for t in ts if t[0] != name])
    fails(single, name, "missing", str(single / SINGLE_NAME))


def test_extra_tensor_under_the_text_prefix(sharded, single):
    # a v_proj on a full layer, where keys = values
    name = MM + "layers.5.self_attn.v_proj.weight"
    edit_shard(sharded / SHARD1, lambda ts: ts + [(name, "BF16", [32, 64], bytes(32 * 64 * 2))])
    edit_index(sharded, lambda wm: wm.__setitem__(name, SHARD1))
    assert "unexpected tensor" in fails(sharded, name, str(sharded / SHARD1))
    name = "model.layers.3.per_layer_input_gate.weight"
    edit_shard(single / SINGLE_NAME, lambda ts: ts + [(name, "BF16", [4], bytes(8))])
    fails(single, name, "unexpected tensor", str(single / SINGLE_NAME))


def test_stored_lm_head_is_an_error(single):
    edit_shard(single / SINGLE_NAME, lambda ts: ts + [("lm_head.weight", "BF16", [512, 64], bytes(512 * 64 * 2))])
    fails(single, "lm_head.weight", "tied", str(single / SINGLE_NAME))


def test_other_towers_are_ignored(sharded, single):
    tower = [("model.vision_tower.encoder.layers.0.mlp.fc1.weight", "F32", [3, 4], bytes(48)),
             ("model.embed_vision.embedding_projection.weight", "BF16", [2, 2], bytes(8)),
             ("model.audio_tower.conv.weight", "I8", [5], bytes(5))]
    edit_shard(sharded / SHARD2, lambda ts: ts + tower)
    edit_index(sharded, lambda wm: wm.update({t[0]: SHARD2 for t in tower}))
    ck = load(sharded)
    assert len(ck) == 666 and not any("tower" in ck.info(n).name for n in ck)
    edit_shard(single / SINGLE_NAME, lambda ts: ts + tower)
    assert len(load(single)) == 666


def test_misshaped_tensor(sharded):
    name = MM + "layers.2.self_attn.q_proj.weight"
    file = shard_of(sharded, name)
    edit_shard(file, lambda ts: [(n, d, s[::-1] if n == name else s, b) for n, d, s, b in ts])
    fails(sharded, name, str(file), "shape [64, 512], expected [512, 64]")


def test_config_that_disagrees_with_the_tensors(sharded):
    doc = json.loads((sharded / "config.json").read_text())
    doc["text_config"]["intermediate_size"] = 256
    (sharded / "config.json").write_text(json.dumps(doc))
    fails(sharded, MM + "layers.0.mlp.gate_proj.weight", "shape [128, 64], expected [256, 64]")


@pytest.mark.parametrize("code,itemsize", [("I8", 1), ("F64", 8), ("I32", 4)])
def test_wrongly_typed_tensor(sharded, code, itemsize):
    name = MM + "layers.4.self_attn.k_norm.weight"
    file = shard_of(sharded, name)
    edit_shard(file, lambda ts: [(n, code, s, bytes(32 * itemsize)) if n == name else (n, d, s, b) for n, d, s, b in ts])
    fails(sharded, name, str(file), f"unsupported dtype {code}")


def test_truncated_file(sharded, single):
    file = sharded / SHARD2
    tensors, _ = read_safetensors(file)
    last = tensors[-1][0]
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 10)
    assert "truncated" in fails(sharded, last, str(file))
    with open(single / SINGLE_NAME, "r+b") as f:
        f.truncate(100)
    fails(single, str(single / SINGLE_NAME), "truncated")
    with open(single / SINGLE_NAME, "r+b") as f:
        f.truncate(5)
    fails(single, str(single / SINGLE_NAME), "truncated", "too short")


def test_header_that_lies_about_sizes(single):
    tensors, _ = read_safetensors(single / SINGLE_NAME)
    name = tensors[3][0]
    edit_shard(single / SINGLE_NAME, lambda ts: [(n, d, s, b[:-2] if n == name else b) for n, d, s, b in ts])
    fails(single, name, str(single / SINGLE_NAME), "corrupt header")
    (single / SINGLE_NAME).write_bytes(struct.pack("<Q", 4) + b"{{{{")
    fails(single, str(single / SINGLE_NAME), "corrupt safetensors header")


def test_index_that_is_not_json(sharded):
    (sharded / INDEX_NAME).write_text('{"weight_map": {')
    fails(sharded, str(sharded / INDEX_NAME), "corrupt index")
    (sharded / INDEX_NAME).write_text('{"metadata": {}}')
    fails(sharded, str(sharded / INDEX_NAME), "no weight_map")


def test_index_pointing_at_a_missing_shard(sharded):
    name = MM + "norm.weight"
    edit_index(sharded, lambda wm: wm.__setitem__(name, "model-00003-of-00002.safetensors"))
    fails(sharded, name, str(sharded / "model-00003-of-00002.safetensors"), "does not exist")
    (sharded / SHARD2).unlink()
    fails(sharded, SHARD2, "does not exist")


def test_index_listing_a_tensor_its_shard_lacks(sharded):
    name = MM + "embed_tokens.weight"
    assert shard_of(sharded, name).name == SHARD1
    edit_index(sharded, lambda wm: wm.__setitem__(name, SHARD2))
    fails(sharded, name, str(sharded / SHARD2), "absent from that shard")


def test_shard_holding_a_tensor_the_index_omits(sharded):
    name = MM + "layers.1.mlp.down_proj.weight"
    edit_index(sharded, lambda wm: wm.pop(name))
    fails(sharded, name, "not listed in")


def test_missing_config(sharded):
    (sharded / "config.json").unlink()
    fails(sharded, str(sharded / "config.json"), "missing config.json")


def test_no_safetensors(tmp_path, sharded):
    for f in sharded.glob("model*"):
        f.unlink()
    fails(sharded, "no model.safetensors or model.safetensors.index.json")
    fails(tmp_path / "nowhere", "not a checkpoint folder")


def test_bad_config_is_a_config_error(sharded):
    doc = json.loads((sharded / "config.json").read_text())
    doc["text_config"]["num_kv_shared_layers"] = 18
    (sharded / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"config\.json: text_config\.num_kv_shared_layers"):
        load(sharded)


def test_the_generator_writes_the_small_geometry_at_another_width(tmp_path):
    """--hidden-size and --intermediate-size widen the small geometry (256: every row whole k-quant blocks)."""
    generate.main([str(tmp_path / "wide"), "--hidden-size=256", "--intermediate-size=256"])
    config = load(tmp_path / "wide").config
    assert (config.hidden_size, config.intermediate_size) == (256, 256)

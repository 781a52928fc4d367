"""checkpoints.gguf_file: a GGUF's weights exported to a checkpoint folder that the suite reads exactly.

The GGUF here is written with the ``gguf`` package's own writer and quantizer (the test extra installs
it), under llama.cpp's tensor names: the exported folder must load as exactly the numbers the GGUF
holds (its blocks dequantized by ``gguf`` itself), under the checkpoint's names.
"""

from __future__ import annotations

import gguf  # the test extra installs it
import numpy as np
import pytest
from gguf import quants

from gemma4_conformance.checkpoints import checkpoint, generate
from gemma4_conformance.checkpoints.gguf_file import GGUF_NAME, GGUFExportError, export


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = generate.write_checkpoint(tmp_path_factory.mktemp("bf16"), generate.small_config(), seed=0)
    return folder, checkpoint.load(folder)


def _write_gguf(path, weights, matrices):
    """A GGUF of ``weights`` under llama.cpp's names: matrices as ``matrices`` (a GGMLQuantizationType), the
    rest F32; returns llama.cpp name -> the values the file holds (float32)."""
    cfg = weights.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_layers)
    writer = gguf.GGUFWriter(path, "gemma4")
    held = {}
    for canonical in checkpoint.canonical_names(cfg):
        name = names.get_name(canonical, try_suffixes=(".weight", ".bias"))
        values = np.asarray(weights[canonical], np.float32)
        kind = matrices if values.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = quants.quantize(values, kind) if kind != gguf.GGMLQuantizationType.F32 else values
        writer.add_tensor(name, data, raw_dtype=kind)
        held[name] = quants.dequantize(data, kind) if kind != gguf.GGMLQuantizationType.F32 else values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def test_an_exported_gguf_loads_as_exactly_its_numbers(source, tmp_path):
    folder, weights = source
    held = _write_gguf(tmp_path / "q8.gguf", weights, gguf.GGMLQuantizationType.Q8_0)
    out = checkpoint.load(export(tmp_path / "q8.gguf", folder, tmp_path / "exported"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, weights.config.num_layers)
    assert set(out) == set(weights)
    assert set(out.weight_formats.values()) == {"q8_0"} and len(out.weight_formats) > 0
    for canonical in out:
        expected = held[names.get_name(canonical, try_suffixes=(".weight", ".bias"))]
        np.testing.assert_array_equal(np.asarray(out[canonical], np.float64).reshape(expected.shape),
                                      expected.astype(np.float64), err_msg=canonical)
    assert (tmp_path / "exported" / GGUF_NAME).read_bytes() == (tmp_path / "q8.gguf").read_bytes()


def test_a_block_type_the_suite_cannot_dequantize_is_named(source, tmp_path):
    folder, weights = source
    _write_gguf(tmp_path / "q5.gguf", weights, gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(GGUFExportError, match=r"token_embd.weight is stored as Q5_0, which the suite cannot"):
        export(tmp_path / "q5.gguf", folder, tmp_path / "exported")

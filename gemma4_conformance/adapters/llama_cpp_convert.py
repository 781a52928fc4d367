"""Convert a Gemma 4 checkpoint folder to GGUF with llama.cpp's own converter (run as a subprocess).

``python -m gemma4_conformance.adapters.llama_cpp_convert SOURCE CHECKPOINT OUTFILE OUTTYPE`` runs
``convert_hf_to_gguf.py``'s classes from the llama.cpp source tree SOURCE (its ``conversion``
package and ``gguf-py``), exactly as that script does, with two additions for checkpoints the
script cannot take as they are, neither of which touches a weight:

* The architecture ``Gemma4UnifiedForCausalLM`` (a text-only Gemma 4 checkpoint, the layout the
  suite generates and the hub's text config names) is not in the converter's registry, which knows
  ``Gemma4ForCausalLM`` and the multimodal ``Gemma4UnifiedForConditionalGeneration``; both are
  converted by its ``Gemma4Model`` class, which is what this one is mapped to.
* A folder without tokenizer files (the suite's generated checkpoints: the suite feeds token ids, so
  there is nothing to tokenize) gets a vocabulary-less GGUF (llama.cpp's tokenizer model ``none``
  with ``vocab_size`` dummy tokens) instead of the converter's failure to open ``tokenizer.json``;
  the embedding is then kept whole (the converter trims it to the tokenizer's length).

Everything else (tensor names, which tensors stay float32, the proportional-RoPE frequency factors,
norm weights stored as ``w``, the layer scalars) is the converter's own.
"""

from __future__ import annotations

import sys
from pathlib import Path

TEXT_ONLY_ARCHITECTURE = "Gemma4UnifiedForCausalLM"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
OUTTYPES = ("f32", "bf16", "f16", "q8_0")  # q8_0: the converter's own quantizer (gguf.quants)


def convert(source: Path, checkpoint: Path, outfile: Path, outtype: str) -> None:
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import gguf
    import torch
    from conversion import ModelBase, get_model_architecture, get_model_class
    from conversion.base import ModelType

    hparams = ModelBase.load_hparams(checkpoint, False)
    architecture = get_model_architecture(hparams, ModelType.TEXT)
    if architecture == TEXT_ONLY_ARCHITECTURE:
        architecture = "Gemma4ForCausalLM"
    model_class = get_model_class(architecture)
    if not any((checkpoint / name).is_file() for name in TOKENIZER_FILES):
        model_class = _without_tokenizer(model_class)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    with torch.inference_mode():
        model = model_class(checkpoint, file_type, outfile, model_name=checkpoint.name)
        model.write()


def _without_tokenizer(model_class):
    class WithoutTokenizer(model_class):
        model_arch = model_class.model_arch  # the converter wants every class to name its architecture

        def set_vocab(self):
            self.gguf_writer.add_tokenizer_model("none")
            self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

        def modify_tensors(self, data_torch, name, bid):
            if "embed_tokens.weight" in name:  # the converter trims the rows to the tokenizer's length
                yield from _above(model_class, "modify_tensors", "Gemma3Model")(self, data_torch, name, bid)
                return
            yield from super().modify_tensors(data_torch, name, bid)

    WithoutTokenizer.__name__ = f"{model_class.__name__}WithoutTokenizer"
    return WithoutTokenizer


def _above(model_class, method: str, class_name: str):
    """``method`` as the first class after ``class_name`` in ``model_class``'s MRO defines it."""
    mro = model_class.__mro__
    names = [c.__name__ for c in mro]
    if class_name not in names:
        raise RuntimeError(f"{model_class.__name__} does not derive from {class_name}: the converter changed; "
                           f"this driver was written for llama.cpp's conversion/gemma.py of llama-cpp-python 0.3.36")
    for cls in mro[names.index(class_name) + 1:]:
        if method in cls.__dict__:
            return cls.__dict__[method]
    raise RuntimeError(f"no {method} above {class_name} in {model_class.__name__}'s classes")


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or args[3] not in OUTTYPES:
        sys.exit(f"usage: python -m gemma4_conformance.adapters.llama_cpp_convert SOURCE CHECKPOINT OUTFILE "
                 f"{{{','.join(OUTTYPES)}}}")
    source, checkpoint, outfile, outtype = Path(args[0]), Path(args[1]), Path(args[2]), args[3]
    convert(source, checkpoint, outfile, outtype)


if __name__ == "__main__":
    main()

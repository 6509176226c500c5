"""Real llama.cpp-type GGUF files of a model, made with the ``gguf`` package's own quantizers.

``gguf`` 0.19 quantizes in Python to Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (and BF16, TQ1_0, TQ2_0,
MXFP4); its k-quants and IQ types only dequantize (`quantizable_types` asks the package).
`requantize_gguf` copies a GGUF file's metadata and tokenizer and stores every 2-D weight at
one type, ``w <- quantize(dequantize(w))`` (llama.cpp's ``--pure``: norms and biases stay F32,
as does a tensor whose rows are not whole blocks of the type); `write_gguf` does it for any
model ``--circuits-model`` accepts (a folder is first written as a float32 GGUF file by
`gguf_write.write_float_gguf`). Files are written atomically; `cached_gguf` keeps one per
(model, type) in the cache, for tests and for ``--circuits-builds q8=FILE``.

Run: ``python -m pytest_circuits.model.gguf_quant smollm2-135m Q8_0 dist/smollm2-Q8_0.gguf``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from ..errors import CircuitsError, ModelLoadError
from .loading import cache_root, resolve_model, sha256_of

FLOAT_TYPES = ("F32",)  # what a tensor that is not quantized is stored as
WRITER = (
    2  # in cached file names; 2: rope.freq_base from rope_parameters, a placeholder vocabulary (llama.cpp loads it)
)


@lru_cache(maxsize=1)
def quantizable_types() -> tuple[str, ...]:
    """GGML types the installed ``gguf`` package can quantize in Python (tried on one zero row)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    found = []
    for qtype in GGMLQuantizationType:
        if qtype.name in ("F32", "F16") or qtype not in GGML_QUANT_SIZES:
            continue
        block = GGML_QUANT_SIZES[qtype][0]
        try:
            quants.quantize(np.zeros((1, block * 2), dtype=np.float32), qtype)
        except (NotImplementedError, KeyError, ValueError, TypeError, AttributeError):
            continue
        found.append(qtype.name)
    return tuple(found)


def _qtype(name: str):
    from gguf import GGMLQuantizationType

    known = quantizable_types()
    if name not in known:
        raise CircuitsError(
            f"GGUF type {name!r} cannot be written by the installed gguf package; it quantizes {', '.join(known)}"
        )
    return GGMLQuantizationType[name]


def _file_type(name: str) -> int | None:
    """``general.file_type`` (llama.cpp's LlamaFileType) of a file mostly of type ``name``."""
    from gguf import LlamaFileType

    member = getattr(LlamaFileType, f"MOSTLY_{name}", None)
    return None if member is None else int(member)


def quantizes(shape: tuple[int, ...], tensor_type: str) -> bool:
    """True when a tensor of numpy ``shape`` is stored at ``tensor_type``: 2-D or more, rows of whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType[tensor_type]][0]
    return len(shape) >= 2 and shape[-1] % block == 0


def requantize_gguf(src: str | Path, dst: str | Path, tensor_type: str, blocks: dict | None = None) -> Path:
    """Copy GGUF ``src`` to ``dst`` with every 2-D weight re-stored at ``tensor_type`` (see module doc).

    ``blocks``: ``{tensor name: (GGML type name, uint8 array of its rows' blocks)}`` stored as
    given, for types no Python quantizer writes (k-quants made by llama.cpp; tests of the read path).
    """
    import gguf
    import numpy as np

    qtype = _qtype(tensor_type) if tensor_type not in FLOAT_TYPES else gguf.GGMLQuantizationType.F32
    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(str(src))
    arch_field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ModelLoadError(f"GGUF file {src} names no general.architecture; it cannot be re-quantized")
    arch = str(arch_field.contents())
    dst.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(staging, arch)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            if field.name == gguf.Keys.General.FILE_TYPE:
                continue  # written below for the new type
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
        file_type = _file_type(tensor_type)
        if file_type is not None:
            writer.add_file_type(file_type)
        for tensor in reader.tensors:
            if blocks and tensor.name in blocks:
                kind_name, raw = blocks[tensor.name]
                writer.add_tensor(tensor.name, raw, raw_dtype=gguf.GGMLQuantizationType[kind_name])
                continue
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            if tensor_type not in FLOAT_TYPES and quantizes(data.shape, tensor_type):
                writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(tensor.name, np.ascontiguousarray(data))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(staging, 0o644)  # mkstemp made it private; the file is an ordinary artifact
        os.replace(staging, dst)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return dst


def float_gguf_of(model: str, dst: str | Path) -> Path:
    """``model`` (anything ``--circuits-model`` takes) as a GGUF file: its own file when it is one,
    else its float32 weights written by `gguf_write.write_float_gguf` with a placeholder vocabulary
    (`placeholder_tokens`: ids only, no text tokenizer; llama.cpp loads no file without one)."""
    source = resolve_model(model)
    if source.origin.suffix == ".gguf":
        return source.origin
    import torch
    from transformers import AutoModelForCausalLM

    from .gguf_write import write_float_gguf
    from .loading import quiet_transformers

    quiet_transformers()
    net = AutoModelForCausalLM.from_pretrained(
        source.folder, dtype=torch.float32, local_files_only=True, use_safetensors=True
    )
    return write_float_gguf(net, dst, tokens=placeholder_tokens(net.config.vocab_size))


def placeholder_tokens(vocab_size: int) -> list[str]:
    """``<id0>``, ``<id1>``, ...: one distinct piece per id (the probe feeds ids, never text)."""
    return [f"<id{i}>" for i in range(vocab_size)]


def write_gguf(model: str, tensor_type: str, dst: str | Path) -> Path:
    """A GGUF file of ``model`` at ``tensor_type`` (every 2-D weight; norms F32), written to ``dst``."""
    dst = Path(dst)
    _qtype(tensor_type)
    with tempfile.TemporaryDirectory(dir=dst.parent if dst.parent.is_dir() else None) as tmp:
        float_file = float_gguf_of(model, Path(tmp) / "float32.gguf")
        return requantize_gguf(float_file, dst, tensor_type)


def cached_gguf(model: str, tensor_type: str) -> Path:
    """`write_gguf` once per (model weights, type, `WRITER`): ``<cache>/quantized/<name>-<sha256[:16]>-<type>-w<WRITER>.gguf``."""
    from ..fsio import safe_name

    source = resolve_model(model)
    key = sha256_of(source.origin) if source.origin.is_file() else _folder_key(source.folder)
    target = cache_root() / "quantized" / f"{safe_name(source.name)}-{key[:16]}-{tensor_type}-w{WRITER}.gguf"
    if not target.is_file():  # written by os.replace: a file there is whole
        write_gguf(model, tensor_type, target)
    return target


def _folder_key(folder: Path) -> str:
    from .loading import weight_fingerprint

    return weight_fingerprint(folder).removeprefix("sha256:")


def main(argv: list[str] | None = None) -> int:
    """``python -m pytest_circuits.model.gguf_quant MODEL TYPE OUT``: write one quantized GGUF file."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        print(
            f"usage: python -m pytest_circuits.model.gguf_quant MODEL TYPE OUT.gguf (TYPE: {', '.join(quantizable_types())})",
            file=sys.stderr,
        )
        return 2
    try:
        path = write_gguf(args[0], args[1], args[2])
    except CircuitsError as error:
        print(f"gguf_quant: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size} bytes, sha256 {sha256_of(path)[:12]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""External builds: a GGUF file or checkpoint someone else produced, gated as a build of the model.

``--circuits-builds fp32,q8=dist/model-Q8_0.gguf`` loads ``dist/model-Q8_0.gguf`` the way
``--circuits-model`` would (`loading.resolve_model`: a GGUF file is dequantized to float32, a
save_pretrained folder may hold a pre-quantized checkpoint such as bitsandbytes-serialized
8-bit or 4-bit weights), refuses it in one line when its geometry is not the model's, and
gives it an identity that names the file: its sha256, format and stored tensor types.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch

from ..errors import CircuitsError, RecipeError
from ..fsio import parse_json
from .builds import BuildIdentity, LoadedBuild, finish_build, from_pretrained, resolve_device, served_cache, with_cache
from .compressed import decompress, identity_fields, is_compressed_tensors, quiet, require, require_compressed_tensors
from .families import Geometry, family_and_geometry
from .loading import ModelSource, check_finite_weights, quiet_transformers, read_config, sha256_of, weight_files
from .recipes import BuildSpec
from .serialized import is_quanto_folder, load_quanto, quanto_fields, torchao_fields
from .vocab import TokenInfo, token_info

GEOMETRY_FIELDS = ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "vocab")


def config_geometry(config) -> Geometry:
    """The `Geometry` a config describes, without loading weights."""
    return family_and_geometry(config)[1]


def _shape(geometry: Geometry) -> str:
    return ", ".join(f"{k} {getattr(geometry, k)}" for k in GEOMETRY_FIELDS)


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF file holds (``{"Q4_K": 97, "Q6_K": 16, "F32": 61}``)."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def safetensors_dtypes(folder: Path) -> dict[str, int]:
    """How many tensors of each stored dtype the weight files of a folder hold (read from the headers)."""
    counts: Counter = Counter()
    for file in weight_files(folder):
        with open(file, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = parse_json(handle.read(size), file)
        counts.update(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return dict(counts)


def quantization_of(config) -> dict | None:
    """The ``quantization_config`` a pre-quantized checkpoint's config.json carries, as a dict."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    return quant if isinstance(quant, dict) else quant.to_dict()


def checkpoint_format(quant: dict | None) -> str:
    """``safetensors``, ``bnb-8bit-serialized``, ``bnb-4bit-nf4-serialized``, or the quant method's name."""
    if quant is None:
        return "safetensors"
    method = str(quant.get("quant_method", "unknown"))
    if method == "bitsandbytes":
        if quant.get("load_in_8bit"):
            return "bnb-8bit-serialized"
        return f"bnb-4bit-{quant.get('bnb_4bit_quant_type', 'fp4')}-serialized"
    if method == "compressed-tensors" and quant.get("format"):
        return f"compressed-tensors-{quant['format']}"
    return method


def _backend_version(package: str) -> str:
    import importlib.metadata as metadata

    try:
        return f"{package} {metadata.version(package)}"
    except metadata.PackageNotFoundError:
        return package


def external_identity(
    spec: BuildSpec, source: ModelSource, quant: dict | None, device, **quantized: str
) -> BuildIdentity:
    """Identity of an external build: NAME, its file, format, sha256 and stored tensor types.

    sha256: of the GGUF file; of a folder, its single weight file's, or `weight_fingerprint`
    over several. Tensor types: GGML types of a GGUF file, stored dtypes of safetensors files.
    """
    if source.origin.suffix == ".gguf" or source.kind == "gguf":
        fmt, backend = "gguf", _backend_version("gguf")
        digest, types = sha256_of(source.origin), gguf_tensor_types(source.origin)
    else:
        quanto = is_quanto_folder(source.folder)
        fmt = "optimum-quanto" if quanto else checkpoint_format(quant)
        method = "optimum-quanto" if quanto else None if quant is None else str(quant.get("quant_method"))
        package = {m: m for m in ("bitsandbytes", "compressed-tensors", "torchao", "optimum-quanto")}
        backend = _backend_version(package.get(method or "", "torch")) if method else f"torch {torch.__version__}"
        files = weight_files(source.folder)
        if len(files) == 1:
            digest = sha256_of(files[0])
        else:
            from .loading import weight_fingerprint

            digest = weight_fingerprint(source.folder).removeprefix("sha256:")
        types = safetensors_dtypes(source.folder)
    return BuildIdentity(
        recipe=spec.name,
        dtype="float32" if quant is None else str(quant.get("bnb_4bit_compute_dtype") or "float32"),
        backend=fmt if quant is None else str(quant.get("quant_method")),  # optimum-quanto: its format
        backend_version=backend,
        device=str(device),
        source=spec.path,
        format=fmt,
        sha256=digest,
        tensor_types=types,
        quantization=quantized.get("quantization"),
        forward=quantized.get("forward"),
    )


def check_external_path(spec: BuildSpec) -> None:
    """Refuse, in one line and before anything loads, an external build whose PATH names nothing:
    not a file, a folder, a named model, or an id in the local Hugging Face cache."""
    from .loading import hub_cache_folder
    from .named import NAMED_MODELS

    text = str(spec.path)
    if text in NAMED_MODELS or Path(text).expanduser().exists():
        return
    if text.count("/") == 1 and not text.startswith(".") and hub_cache_folder(text) is not None:
        return
    raise RecipeError(
        f"external build {spec}: {text} does not exist (not a .gguf file, a model folder, a named model "
        "or a local Hugging Face cache id); check the path after NAME="
    )


def load_external_build(
    model: ModelSource,
    spec: BuildSpec,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    tokens: TokenInfo | None = None,
) -> LoadedBuild:
    """Load the external build ``spec`` (NAME=PATH) of ``model``: same geometry, same probe tokens.

    The probe tokens are the model's (``tokens``, else read from ``model``), so the build sees
    exactly the sequences the model's recipe builds see. A quantized checkpoint loads through its
    own ``quantization_config`` (a compressed-tensors one decompressed to float32 by its own
    decompressor, `compressed`); any other weights load as float32.
    """
    from .loading import resolve_model

    if spec.path is None:
        raise RecipeError(f"build {spec.name} is a recipe, not an external build; load it with load_build")
    quiet_transformers()
    device = device if isinstance(device, torch.device) else resolve_device(device)
    check_external_path(spec)
    try:
        source = resolve_model(spec.path)
    except CircuitsError as error:
        raise type(error)(f"external build {spec}: {error}") from None
    config = read_config(source.folder, trust_remote_code, spec.path)
    model_config = read_config(model.folder, trust_remote_code, model.spec)
    family, geometry = family_and_geometry(config)
    expected = config_geometry(model_config)
    if geometry != expected:
        raise RecipeError(
            f"external build {spec}: its geometry ({_shape(geometry)}) is not that of {model.name} "
            f"({_shape(expected)}); an external build must be a build of the same model"
        )
    if tokens is None:
        tokens = token_info(model.folder, model_config, trust_remote_code)
    check_finite_weights(source)
    quant = quantization_of(config)
    compressed = is_compressed_tensors(quant)
    if compressed:
        require_compressed_tensors(f"external build {spec} (a compressed-tensors checkpoint)")
    elif quant is not None and quant.get("quant_method") == "torchao":
        require("torchao", "torchao", f"external build {spec} (a torchao checkpoint)")
    if quant is None:
        kwargs: dict = dict(dtype=torch.float32)
    else:  # compressed-tensors: float32 scales and dense layers, so W = (q - z) s comes out in float32
        kwargs = dict(device_map={"": str(device)}) | (dict(dtype=torch.float32) if compressed else {})
    quanto = is_quanto_folder(source.folder)
    cache = served_cache(quant, source.folder, config, str(spec)) if compressed else None
    if quanto:
        net = load_quanto(source.folder, f"external build {spec}").to(device)
    else:
        with quiet() if compressed else nullcontext():
            net = from_pretrained(
                source.folder, str(spec), device, trust_remote_code, cache_scales=cache is not None, **kwargs
            )
    if quant is None and not quanto:
        net = net.to(device=device, dtype=torch.float32)
    quantized: dict[str, str] = {}
    if compressed and quant is not None:
        quantized = identity_fields(decompress(net), quant)
    elif quant is not None and quant.get("quant_method") == "torchao":
        quantized = torchao_fields(net, quant)
    elif quanto:
        quantized = quanto_fields(net, getattr(net, "quanto_qmap", {}))
    identity = external_identity(spec, source, quant, device, **quantized)
    llm_int8 = bool(quant and quant.get("quant_method") == "bitsandbytes" and quant.get("load_in_8bit"))
    return with_cache(finish_build(net, model, identity, family, tokens, llm_int8=llm_int8), cache)

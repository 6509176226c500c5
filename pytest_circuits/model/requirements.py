"""What a build needs beyond the core install, checked before any work (`run.steps.preflight`).

A recipe of the ``formats`` extra (``fp8-e4m3``, ``fp8-e4m3-dyn``, ``int8-w8a8``: compressed-tensors),
one made in another environment (``gptq-int4``, ``awq-int4``: llm-compressor, `calibrated`), the
``bnb-*`` recipes (bitsandbytes) and a cache run by transformers' ``QuantizedCache``
(``+kv-quanto-*``: optimum-quanto, ``+kv-hqq-*``: hqq), and an external checkpoint of such a format,
are each refused in one line naming the fix before the model is loaded: under pytest a build that
cannot be made is a usage error (exit 4), never a failed invariant; ``circuits`` exits 2. The same
checks run again where each build is made.
"""

from __future__ import annotations

from .recipes import CT, LLMC, BuildSpec, get_recipe


def check_build_needs(spec: BuildSpec) -> None:
    """Refuse ``spec`` in one line (`RecipeError`) when a package or environment it needs is missing."""
    kv = spec.kv
    if kv is not None and kv.decode:
        from .quantized_cache import require_backend

        require_backend(kv)
    if spec.external:
        _external_needs(spec)
        return
    recipe = get_recipe(spec.weights.name)
    if recipe.backend == "bitsandbytes":
        from .builds import require_bitsandbytes

        require_bitsandbytes(recipe.name)
    elif recipe.backend == CT:
        from .compressed import require_compressed_tensors

        require_compressed_tensors(f"recipe {recipe.name}")
    elif recipe.backend == LLMC:
        from .calibrated import llmc_python, llmc_version

        llmc_version(llmc_python(recipe.name))


def _external_needs(spec: BuildSpec) -> None:
    """An external checkpoint folder's format, from its config.json (read as JSON, nothing imported):
    compressed-tensors and torchao checkpoints and optimum-quanto folders need their package. A .gguf
    file needs gguf, a core dependency; a config that cannot be read is said where the build is loaded."""
    from pathlib import Path

    from ..fsio import JsonUnreadable, read_json
    from .compressed import is_compressed_tensors, require, require_compressed_tensors
    from .serialized import QUANTO_MAP, require_quanto

    folder = Path(str(spec.path)).expanduser()
    if not folder.is_dir():
        return
    try:
        config = read_json(folder / "config.json")
    except JsonUnreadable:
        return
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    quant = quant if isinstance(quant, dict) else None
    what = f"external build {spec}"
    if is_compressed_tensors(quant):
        require_compressed_tensors(f"{what} (a compressed-tensors checkpoint)")
    elif quant is not None and quant.get("quant_method") == "torchao":
        require("torchao", "torchao", f"{what} (a torchao checkpoint)")
    if (folder / QUANTO_MAP).is_file():
        require_quanto(what)

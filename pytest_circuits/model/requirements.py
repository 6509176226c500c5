"""What a build needs beyond the core install, checked before any work (`run.steps.preflight`).

A recipe of the ``formats`` extra (``fp8-e4m3``, ``fp8-e4m3-dyn``, ``int8-w8a8``: compressed-tensors),
one made in another environment (``gptq-int4``, ``awq-int4``: llm-compressor, `calibrated`), the
``bnb-*`` recipes (bitsandbytes) and a cache run by transformers' ``QuantizedCache``
(``+kv-quanto-*``: optimum-quanto, ``+kv-hqq-*``: hqq) are each refused in one line naming the fix
before the model is loaded: under pytest a build that cannot be made is a usage error (exit 4),
never a failed invariant; ``circuits`` exits 2. The same checks run again where each build is made.
"""

from __future__ import annotations

from .recipes import CT, LLMC, BuildSpec, get_recipe


def check_build_needs(spec: BuildSpec) -> None:
    """Refuse ``spec`` in one line (`RecipeError`) when a package or environment it needs is missing."""
    kv = spec.kv
    if kv is not None and kv.decode:
        from .quantized_cache import require_backend

        require_backend(kv)
    if spec.external:  # its format is known only once its config is read (`external.load_external_build`)
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

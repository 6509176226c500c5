"""Model families: the declarative table (`family_table.py`; its quirk tags `quirks.py`, its documented
table `family_docs.py`), which family a model is
(`family_resolution.py`), its modules by path and by family (`module_paths.py`,
`family_modules.py`: blocks, attention, norms, the tail maths) and the Q/K/V packings
(`qkv_layouts.py`). Import them from here or from their own module.
"""

from __future__ import annotations

from .family_docs import families_markdown
from .family_modules import (
    SLIDING_LAYER_TYPES,
    active_quirks,
    attention_block,
    attention_module,
    attention_windows,
    embed_scale_of,
    flattens_batch_with_heads,
    layer_modules,
    logit_factor_of,
    out_proj_module,
    tail_logits,
)
from .family_resolution import (
    all_families,
    attention_blocks,
    bind_family,
    check_geometry,
    family_and_geometry,
    family_for_config,
    family_of,
    geometry_for,
    geometry_of,
    infer_family,
    plugin_families,
    supported_model_types,
)
from .family_stacks import NO_PER_HEAD_OV
from .family_table import (
    ENTRY_POINT_GROUP,
    FAMILIES,
    GPT2,
    GPT_NEOX,
    HYBRID_LAYER_ATTRS,
    LLAMA,
    Family,
    Geometry,
    head_label,
)
from .module_paths import (
    attn_norm_module,
    final_norm_module,
    get_module,
    modules_at,
    post_attn_norm_module,
)
from .qkv_layouts import (
    QKV_LAYOUTS,
    qkv_rows,
    split_qkv,
)
from .quirks import QUIRKS

__all__ = [
    "ENTRY_POINT_GROUP",
    "FAMILIES",
    "Family",
    "GPT2",
    "GPT_NEOX",
    "Geometry",
    "HYBRID_LAYER_ATTRS",
    "LLAMA",
    "NO_PER_HEAD_OV",
    "QKV_LAYOUTS",
    "QUIRKS",
    "SLIDING_LAYER_TYPES",
    "active_quirks",
    "all_families",
    "attention_block",
    "attention_blocks",
    "attention_module",
    "attention_windows",
    "attn_norm_module",
    "bind_family",
    "check_geometry",
    "embed_scale_of",
    "families_markdown",
    "family_and_geometry",
    "family_for_config",
    "family_of",
    "final_norm_module",
    "flattens_batch_with_heads",
    "geometry_for",
    "geometry_of",
    "get_module",
    "head_label",
    "infer_family",
    "layer_modules",
    "logit_factor_of",
    "modules_at",
    "out_proj_module",
    "plugin_families",
    "post_attn_norm_module",
    "qkv_rows",
    "split_qkv",
    "supported_model_types",
    "tail_logits",
]

"""Refuse a checkpoint that does not hold exactly the model's weights.

transformers initialises any parameter missing from a checkpoint at random, with a warning
(its load report) that is easy to miss; every figure of that layer would then be noise. With
``output_loading_info=True`` it returns the lists: ``missing_keys`` (parameters the checkpoint
lacks; tied weights such as an ``lm_head`` shared with the embedding are not listed),
``unexpected_keys`` (tensors the architecture has no place for: the checkpoint is not of this
architecture, or a weight is stored under another name) and ``mismatched_keys``. Any of them
refuses the load in one line naming the first tensor and the count.
"""

from __future__ import annotations

from ..errors import ModelLoadError


def check_loading_info(info: dict, what: str) -> None:
    """Raise `ModelLoadError` when transformers reports missing, unexpected or mismatched tensors."""
    problems = []
    for key, said in (
        ("missing_keys", "missing from the checkpoint (transformers would initialise it at random)"),
        ("unexpected_keys", "in the checkpoint but not in the architecture"),
        ("mismatched_keys", "of another shape than the architecture's"),
    ):
        names = sorted(str(name if isinstance(name, str) else name[0]) for name in info.get(key) or ())
        if names:
            problems.append(f"{len(names)} tensor{'s' if len(names) > 1 else ''} {said} (first: {names[0]})")
    if problems:
        raise ModelLoadError(
            f"{what}: {'; '.join(problems)}; refusing to read figures from an incomplete or foreign checkpoint "
            "(re-save it with save_pretrained, or re-convert the file)"
        )

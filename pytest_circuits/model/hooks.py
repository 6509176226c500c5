"""The one way the package hooks a model: `hooked`, a context manager that adds hooks and always removes them.

Every module that reads or changes a model's activations goes through it (tests/test_hooks.py
checks that nothing else calls torch's ``register_forward_hook`` / ``register_forward_pre_hook``),
so no hook outlives its block, an exception included. The idea is TransformerLens' ``hooks()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KINDS = {
    "pre": (True, False),  # fn(module, args) -> new args or None
    "pre_kwargs": (True, True),  # fn(module, args, kwargs) -> (args, kwargs) or None
    "forward": (False, False),  # fn(module, args, output) -> new output or None
    "forward_kwargs": (False, True),  # fn(module, args, kwargs, output) -> new output or None
}
"""Hook kinds: ``(runs before the forward, receives the keyword arguments)``; torch's signatures."""

Hook = tuple["torch.nn.Module", str, Callable[..., Any]]
"""``(module, kind, fn)``: ``fn`` hooked on ``module`` as a `KINDS` hook."""


@contextmanager
def hooked(*hooks: Hook) -> Iterator[None]:
    """Inside the block, each ``(module, kind, fn)`` of ``hooks`` is hooked, in the order given.

    On exit, normal or by an exception (a bad kind included), every hook added is removed.
    """
    handles = []
    try:
        for module, kind, fn in hooks:
            if kind not in KINDS:
                raise ValueError(f"hook kind {kind!r} is not one of {', '.join(KINDS)}")
            pre, with_kwargs = KINDS[kind]
            if pre:
                handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))
            else:
                handles.append(module.register_forward_hook(fn, with_kwargs=with_kwargs))
        yield
    finally:
        for handle in handles:
            handle.remove()

"""The unembedding's input in row-major strides (torch's CPU bfloat16 matmul needs it).

``F.linear(x, W_U)`` on a CPU with a 3-D bfloat16 ``x`` whose strides are not row-major (a slice
of the positions, ``hidden[:, -L:]``, as transformers' ``logits_to_keep`` takes it, or a batch of
one cut from a longer sequence) runs a batched matmul that materialises ``W_U`` once per sequence.
Measured (torch 2.13, this project's 2-core CPU): 8 sequences x 64 positions against
Llama-3.2-1B's unembedding (128,256 x 2,048, 0.53 GB in bf16) held 4.3 GB more for 104 s; the same
values copied to row-major strides first held 0.13 GB more for 3.9 s, with the same logits.
The copy is ``n L d_model`` values of the input, not the vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .hooks import hooked


def row_major_strides(shape) -> tuple[int, ...]:
    """The strides of a freshly allocated tensor of ``shape`` (``stride[i] = prod(shape[i+1:])``)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def row_major(x):
    """``x`` itself when its strides are row-major, else a row-major copy of it (same values)."""
    if torch.is_tensor(x) and x.stride() != row_major_strides(x.shape):
        return x.clone(memory_format=torch.contiguous_format)
    return x


@contextmanager
def row_major_unembedding(model):
    """Inside the block, the model's output embedding gets its input in row-major strides."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        yield
        return

    def pack(module, args, kwargs):
        if args:
            return (row_major(args[0]), *args[1:]), kwargs
        key = next(iter(kwargs), None)
        return args, kwargs if key is None else {**kwargs, key: row_major(kwargs[key])}

    with hooked((head, "pre_kwargs", pack)):
        yield

"""The activations of a hybrid stack's Mamba-2 mixers run through transformers' PyTorch reference
scan, and the rows they allow.

Without the ``mamba_ssm`` kernels (none on a CPU) transformers runs the Mamba-2 mixers of
`falcon_h1`, `bamba`, `granitemoehybrid` and `nemotron_h` through its reference chunked scan, in
float32: the inputs ``B`` and ``C`` repeated to every SSM head, the decay and score matrices of every
chunk, the state at every chunk boundary. A forward with gradients keeps them all for the backward:
at Falcon-H1-1.5B's shape and the probe's 129 tokens, 117 MB per block and sequence, where the same
block's attention and MLP keep 8 MB. Rather than a formula per transformers version,
`kept_bytes` counts what autograd keeps, in one forward of one sequence. The screen decides from it
whether its backward recomputes each block (`screen.screen_layout`); `scan_rows` caps the
sequences of a forward without gradients, which holds one block's intermediates at a time; and a
large such build maps its large blocks (`lean_heap`), so that the freed ones go back to the system.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import platform
import weakref
from functools import cache
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .family_modules import layer_modules

# SSM heads, state size and chunk size per config, first match wins: a model with all three has Mamba-2 mixers
SSM_ATTRS = (
    ("mamba_n_heads", "mamba_d_state", "mamba_chunk_size"),
    ("mamba_num_heads", "ssm_state_size", "chunk_size"),
)
ACTIVATION_FLOOR = 256 << 20  # the budget: this plus an eighth of the weights (`activation_budget`)
# A forward without gradients holds one block's intermediates at once, and the allocator's slack: the
# resident memory of one Falcon-H1-1.5B block at the probe's length rose 1.4-1.6x what the block keeps
# for a backward (one and eight sequences, chunks 64 and 256), so twice that is budgeted per sequence.
NO_GRAD_FACTOR = 2
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {tokens: bytes}


def reference_scan(model: Any, device: str | torch.device) -> bool:
    """Whether ``model`` has Mamba-2 mixers that run transformers' reference scan on ``device`` (no
    ``mamba_ssm`` kernels: every CPU)."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("mamba_ssm") is not None:
        return False
    config = getattr(model, "config", None)
    return any(all(getattr(config, name, None) for name in names) for names in SSM_ATTRS)


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters, as loaded (quantized ones at their stored size)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def activation_budget(model: Any) -> int:
    """Bytes one chunk's activations may hold: ``ACTIVATION_FLOOR + weights / 8``."""
    return ACTIVATION_FLOOR + weight_bytes(model) // 8


def kept_bytes(model: Any, tokens: int) -> int:
    """Bytes autograd keeps for the backward of one sequence of ``tokens`` through ``model``: one
    forward from a leaf at the input embeddings under `torch.autograd.graph.saved_tensors_hooks`
    (which count each saved storage once while it lives, parameters and buffers not, and keep none).
    Measured once per model and length."""
    per_model = _KEPT.setdefault(model, {})
    if tokens not in per_model:
        own = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
        seen: dict[int, StorageWeakRef] = {}  # storage address -> the storage last counted there
        counted = [0]

        def pack(tensor: torch.Tensor) -> None:  # counted, not kept: the count holds no memory
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address in own or (address in seen and not seen[address].expired()):
                return  # the model's own, or a storage counted and still alive
            seen[address] = StorageWeakRef(storage)
            counted[0] += storage.nbytes()

        embed = model.get_input_embeddings()
        ids = torch.zeros(1, tokens, dtype=torch.long, device=embed.weight.device)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _not_kept):
            model(inputs_embeds=embed(ids).detach().requires_grad_(), use_cache=False)
        per_model[tokens] = counted[0]
    return per_model[tokens]


def _not_kept(_: object) -> torch.Tensor:
    raise RuntimeError("kept_bytes counts what a backward would keep and keeps none of it: there is no backward")


def block_bytes(model: Any, tokens: int) -> int:
    """What one block keeps for a backward, per sequence: `kept_bytes` over the blocks."""
    return kept_bytes(model, tokens) // len(layer_modules(model))


def scan_rows(model: Any, batch_size: int, tokens: int, device: str | torch.device) -> int:
    """Sequences per forward without gradients: ``batch_size``, or on a `reference_scan` as few as
    keep ``NO_GRAD_FACTOR x block_bytes`` a sequence under `activation_budget` (at least one)."""
    if not reference_scan(model, device):
        return batch_size
    per_row = NO_GRAD_FACTOR * block_bytes(model, tokens)
    return max(1, min(batch_size, activation_budget(model) // max(per_row, 1)))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MAPPED_FROM_BYTES = 1 << 20
LARGE_MODEL_BYTES = 1 << 30


@cache
def map_large_blocks() -> bool:
    """On glibc, give every allocation of `MAPPED_FROM_BYTES` or more its own mapping, returned to the
    system when freed (``mallopt(M_MMAP_THRESHOLD)``, once a process); False elsewhere. glibc's own
    threshold rises to the largest block freed (up to 32 MB), after which the reference scan's float32
    intermediates (9-13 MB each at Falcon-H1-1.5B's shape) are carved from the heap, which fragments:
    the screen's backward over 12 such blocks at two sequences peaked 2.2 GB over the weights, 0.4 GB
    with the threshold fixed."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MAPPED_FROM_BYTES))


def lean_heap(model: Any, device: str | torch.device) -> bool:
    """`map_large_blocks` for a build of more than `LARGE_MODEL_BYTES` of weights on the reference
    scan, the one kind whose freed intermediates otherwise stay resident; whether it was done."""
    if not reference_scan(model, device):
        return False
    if weight_bytes(model) <= LARGE_MODEL_BYTES:
        return False
    return map_large_blocks()

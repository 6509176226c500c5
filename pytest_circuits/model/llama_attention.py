"""llama.cpp's attention patterns, read through its eval callback (``cb_eval``) as its graph runs.

Without flash attention llama.cpp computes each layer's pattern as the tensor ``kq_soft_max-<layer>``,
``[n_kv, n_tokens, n_head, n_stream]`` float32 (ggml's order: the first index varies fastest). The
scheduler asks the callback about every node (``ask``: return True to see it) and then hands over
the nodes it asked for once computed; `PatternReader` hands each pattern on (the probe reduces it to
its routing sums and drops it, as the torch probe's hooks do: `rungs.llama_probe`). With flash attention
(which a quantized V cache needs) llama.cpp never forms the pattern: nothing is read, and
`PatternReader.seen` stays empty.

The callback is set on the context parameters `llama_cpp.Llama` creates its context with
(`with_eval_callback`), since ``Llama`` takes none itself. `GgmlTensor` mirrors ``struct
ggml_tensor`` of the ggml that llama-cpp-python 0.3.36 vendors (ggml.h: 4 dims, 64-byte op params,
10 sources, 64-byte names).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

PATTERN = "kq_soft_max-"  # llama-graph.cpp: cb(kq, "kq_soft_max", il) names it "kq_soft_max-<il>"
GGML_TYPE_F32 = 0


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` (ggml.h), as far as its name and data."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class PatternReader:
    """The eval callback: hands each layer's pattern, ``(n_head, T, T)`` float32 (queries by the
    sequence's own keys), to ``on_pattern(layer, pattern)`` as llama.cpp computes it, for sequences of
    ``T`` positions. ``error``: the first failure inside the callback (a callback cannot raise into
    C); ``seen``: the layers read."""

    def __init__(self, n_layers: int, T: int, on_pattern):
        self.n_layers, self.T, self.on_pattern = n_layers, T, on_pattern
        self.seen: set[int] = set()
        self.error: str | None = None

    def __call__(self, address: int, ask: bool, _user) -> bool:
        try:
            tensor = GgmlTensor.from_address(address)
            name = tensor.name.split(b"\0", 1)[0].decode("ascii", "replace")
            if not name.startswith(PATTERN):
                return not ask  # never ask for it; a False after computing would stop the graph
            if ask:
                return True
            layer = int(name[len(PATTERN) :])
            self.on_pattern(layer, self.pattern(layer, tensor))
            self.seen.add(layer)
        except Exception as error:  # noqa: BLE001  (kept and raised by the caller, after the graph)
            self.error = self.error or f"{type(error).__name__}: {error}"
        return True

    def pattern(self, layer: int, tensor: GgmlTensor):
        """A copy of the pattern ``(n_head, T, T)``: the keys past ``T`` are the cache's empty cells."""
        import numpy as np

        n_kv, n_tokens, n_head, n_stream = (int(x) for x in tensor.ne)
        if tensor.type != GGML_TYPE_F32 or tensor.nb[0] != 4 or tensor.nb[1] != 4 * n_kv:
            raise ValueError(f"{tensor.name!r} is not a contiguous float32 pattern")
        if n_tokens != self.T or n_stream != 1 or not 0 <= layer < self.n_layers:
            raise ValueError(
                f"layer {layer}: a pattern of {n_tokens} queries x {n_stream} streams, {self.T} x 1 expected"
            )
        values = ctypes.cast(tensor.data, ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(values, shape=(n_head, n_tokens, n_kv))[:, :, : self.T].copy()


@contextmanager
def with_eval_callback(llama_cpp, reader):
    """While open, every llama.cpp context `llama_cpp.Llama` creates calls ``reader`` as its eval callback.

    Yields the ctypes callback: keep it alive as long as the context."""
    module = llama_cpp.llama_cpp
    original = module.llama_context_default_params
    callback = module.ggml_backend_sched_eval_callback(reader)

    def params():
        made = original()
        made.cb_eval = callback
        made.cb_eval_user_data = None
        return made

    module.llama_context_default_params = params
    try:
        yield callback
    finally:
        module.llama_context_default_params = original

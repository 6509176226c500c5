"""llama.cpp's cache layout (model/ggml_layout.py): its key order and Walsh-Hadamard rotation, each
against the formula written out here from llama.cpp's source (convert_hf_to_gguf.py's ``permute``,
llama-kv-cache.cpp's ``ggml_gen_hadamard``), and the simulated blocks against the gguf package's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pytest_circuits.model.ggml_layout import (
    GgmlLayout,
    ggml_layout,
    hadamard,
    interleaved_order,
    key_rotation,
    rotation_disabled,
)
from pytest_circuits.model.kv_cache import quantize_keys, quantize_values
from pytest_circuits.model.kv_formats import parse_kv


@pytest.mark.parametrize("n", [64, 128])
def test_the_rotation_is_sylvesters_walsh_hadamard_matrix(n):
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    signs = np.vectorize(lambda a: (-1) ** bin(a).count("1"))(i & j)  # H[i, j] = (-1)^popcount(i & j) / sqrt(n)
    np.testing.assert_array_equal(hadamard(n).numpy(), (signs / np.sqrt(n)).astype(np.float32))
    np.testing.assert_allclose((hadamard(n) @ hadamard(n)).numpy(), np.eye(n), atol=1e-6)


def test_keys_follow_the_converters_rotary_permutation():
    """convert_hf_to_gguf.py: ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2).reshape(w.shape)`` on W_K's rows."""
    n_head, d = 3, 64
    rows = np.arange(n_head * d)
    gguf_rows = rows.reshape(n_head, 2, d // 2).swapaxes(1, 2).reshape(-1)
    order = interleaved_order(d).numpy()
    np.testing.assert_array_equal(gguf_rows, (np.arange(n_head)[:, None] * d + order[None, :]).reshape(-1))
    assert list(order[:4]) == [0, 32, 1, 33]  # a block of 32 holds channels 0..15 and 32..47


@pytest.mark.parametrize(("d_head", "n"), [(32, 0), (96, 0), (64, 64), (128, 128), (192, 64), (256, 256)])
def test_the_key_rotation_is_the_largest_power_of_two_dividing_the_head(d_head, n):
    assert key_rotation(d_head) == n


@pytest.mark.parametrize(("value", "off"), [(None, False), ("0", False), ("1", True), ("2", True), ("x", False)])
def test_the_switch_reads_as_llama_cpps_atoi(value, off):
    assert rotation_disabled({} if value is None else {"LLAMA_ATTN_ROT_DISABLE": value}) is off


def test_which_models_get_which_layout():
    assert ggml_layout("llama", 64, {}) == GgmlLayout(True, 64, 64)
    assert ggml_layout("qwen2", 128, {}) == GgmlLayout(False, 128, 64)
    assert ggml_layout("llama", 32, {}) == GgmlLayout(True, 0, 0)
    assert ggml_layout("llama", 64, {"LLAMA_ATTN_ROT_DISABLE": "1"}) == GgmlLayout(True, 0, 0, disabled=True)
    assert "64x64 Walsh-Hadamard" in ggml_layout("llama", 64, {}).describe()
    assert "interleaved" in ggml_layout("llama", 64, {}).describe()
    assert "LLAMA_ATTN_ROT_DISABLE set" in ggml_layout("llama", 64, {"LLAMA_ATTN_ROT_DISABLE": "1"}).describe()


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q5_1"])
def test_the_cache_returns_what_llama_cpp_stores_read_back_through_q(kind):
    """llama.cpp stores ``dq(H P k)`` and scores it against ``H P q``; the simulation hands attention
    ``P^T H dq(H P k)`` against ``q``: the same scores. Values: stored ``dq(H v)``, output times H."""
    from gguf import GGMLQuantizationType, quants

    g = torch.Generator().manual_seed(1)
    k, v, q = (torch.randn(2, 3, 5, 64, generator=g) * 3 for _ in range(3))
    layout, spec, qtype = GgmlLayout(True, 64, 64), parse_kv(kind.lower()), GGMLQuantizationType[kind]
    H, P = hadamard(64).double().numpy(), interleaved_order(64).numpy()

    def stored(x):  # the gguf package's blocks of 32 on float32 rows, as llama.cpp's set_rows writes them
        x32 = x.astype(np.float32)
        return quants.dequantize(quants.quantize(x32, qtype), qtype).astype(np.float64)

    kn, vn, qn = (t.double().numpy() for t in (k, v, q))
    their_scores = np.einsum("...td,...sd->...ts", qn[..., P] @ H, stored(kn[..., P] @ H))
    our_scores = np.einsum("...td,...sd->...ts", qn, quantize_keys(k, spec, stored=layout).double().numpy())
    np.testing.assert_allclose(our_scores, their_scores, rtol=0, atol=1e-3)
    np.testing.assert_allclose(quantize_values(v, spec, stored=layout).numpy(), stored(vn @ H) @ H, rtol=0, atol=1e-4)
    assert not np.allclose(our_scores, np.einsum("...td,...sd->...ts", qn, stored(kn)), atol=1e-2)

"""The unembedding gets its input in row-major strides (model/unembedding.py): a strided bf16 slice
makes torch's CPU matmul materialise W_U once per sequence (4.3 GB more at Llama-3.2-1B's shape)."""

from __future__ import annotations

import pytest
import torch

from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.selfcheck import measure_decomposition
from pytest_circuits.model.unembedding import row_major, row_major_strides
from pytest_circuits.rungs import replay
from pytest_circuits.rungs.repeat import bos_offset
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import save_tiny_model


def test_row_major_copies_only_strided_inputs():
    hidden = torch.randn(3, 9, 4)
    assert row_major(hidden) is hidden
    for part in (hidden[:, -5:], hidden[:1, -1:], hidden[:1, 2:7]):  # the last two are 'contiguous' to torch
        packed = row_major(part)
        assert packed is not part and torch.equal(packed, part)
        assert packed.stride() == row_major_strides(part.shape) == torch.empty(part.shape).stride()
    assert row_major_strides((1, 1, 4)) == (4, 4, 1)


@pytest.fixture(scope="module")
def bf16_build(tmp_path_factory):
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("unembed") / "llama", seed=3, initializer_range=0.2)
    return load_build(resolve_model(str(folder)), "bf16", "cpu")


def unembedding_inputs(build, monkeypatch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Record the shape and strides of every input the output embedding's own forward receives."""
    head = build.model.get_output_embeddings()
    seen, forward = [], head.forward

    def spy(x, *args, **kwargs):
        seen.append((tuple(x.shape), x.stride()))
        return forward(x, *args, **kwargs)

    monkeypatch.setattr(head, "forward", spy)
    return seen


def test_intact_pass_and_self_check_unembed_row_major_inputs(bf16_build, monkeypatch):
    seen = unembedding_inputs(bf16_build, monkeypatch)
    settings = RepeatSettings(seed=1, n=5, L=12)
    ids = replay.held_out_ids(bf16_build, settings)
    intact = replay.intact_pass(bf16_build, ids, settings.L, 3, trace=True)  # logits_to_keep=L: a slice
    measure_decomposition(bf16_build)  # logits_to_keep=1 of one sequence
    assert [shape for shape, _ in seen[:3]] == [(3, settings.L, 64), (2, settings.L, 64), (1, 1, 64)]
    assert all(stride == row_major_strides(shape) for shape, stride in seen), seen
    # the same copy losses as a full forward's logits, read independently
    with torch.no_grad():
        logits = bf16_build.model(input_ids=ids, use_cache=False).logits.float()
    start = bos_offset(bf16_build.tokens) + settings.L
    logp = torch.log_softmax(logits[:, start : start + settings.L - 1], dim=-1)
    own = -logp.gather(-1, ids[:, start + 1 :, None]).squeeze(-1).mean(dim=1)
    assert torch.allclose(intact.losses.float(), own, atol=3e-2)

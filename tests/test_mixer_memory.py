"""The rows a hybrid stack's reference Mamba-2 scan allows (model/mixer_memory.py, #52): one forward and a
stacked knockout replay alike stay under the budget at Falcon-H1-1.5B's shape; other models keep theirs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pytest_circuits.model.mixer_memory import ACTIVATION_FLOOR, reference_scan_bytes, scan_rows

T = 129  # the default probe's tokens: 2 x 64 and a BOS


@pytest.fixture(scope="module")
def falcon_1_5b():
    """Falcon-H1-1.5B's shape (its config.json's dimensions), on the meta device: no memory, real parameter sizes."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(
        hidden_size=2048,
        intermediate_size=4608,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=65537,
        tie_word_embeddings=False,
        mamba_d_ssm=3072,
        mamba_n_heads=48,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=256,
        mamba_d_conv=4,
    )
    with torch.device("meta"):
        return FalconH1ForCausalLM(config).to(torch.bfloat16)


def test_the_reference_scan_of_falcon_h1_1_5b_takes_one_sequence_at_a_time(falcon_1_5b):
    # ceil(129 / 256) chunk of 256 x 256 positions x 48 heads x 256 state channels, bfloat16: 1.61 GB a sequence
    assert falcon_1_5b.config.mamba_chunk_size == 256
    assert reference_scan_bytes(falcon_1_5b, T, "cpu") == 256 * 256 * 48 * 256 * 2
    weights = sum(p.numel() * p.element_size() for p in falcon_1_5b.parameters())
    assert ACTIVATION_FLOOR + weights // 8 < 256 * 256 * 48 * 256 * 2  # so not even two sequences fit
    assert scan_rows(falcon_1_5b, 8, T, "cpu") == 1
    assert reference_scan_bytes(falcon_1_5b, 257, "cpu") == 2 * 256 * 256 * 48 * 256 * 2  # a second chunk


def test_a_stacked_knockout_replay_is_capped_like_one_forward(falcon_1_5b):
    """The replay stacks knockouts on the sequences of a pass (about 2,048 tokens on a CPU): on the
    reference scan that is rows x stacked sequences at once, capped as one forward's rows."""
    from pytest_circuits.rungs.knockout import _auto_per_pass

    build = SimpleNamespace(model=falcon_1_5b, device=torch.device("cpu"), llm_int8=False)
    assert _auto_per_pass(build, None, 1, 8, T) == 1


def test_models_without_a_reference_scan_keep_their_rows():
    from pytest_circuits.rungs.knockout import CPU_TOKENS_PER_PASS, _auto_per_pass
    from pytest_circuits.testing import make_tiny_model

    llama, falcon = make_tiny_model("llama"), make_tiny_model("falcon_h1")
    assert reference_scan_bytes(llama, T, "cpu") == 0 and scan_rows(llama, 8, T, "cpu") == 8
    assert reference_scan_bytes(falcon, T, "cpu") > 0 and scan_rows(falcon, 8, T, "cpu") == 8  # small: under budget
    for model in (llama, falcon):
        build = SimpleNamespace(model=model, device=torch.device("cpu"), llm_int8=False)
        assert _auto_per_pass(build, None, 8, 4, 33) == round(CPU_TOKENS_PER_PASS / (4 * 33))

"""The random-repeat probe: every score and loss checked against an independent computation."""

from __future__ import annotations

import dataclasses
import math
import weakref

import numpy as np
import pytest
import torch

from pytest_circuits.errors import CircuitsError
from pytest_circuits.model.builds import LoadedBuild, load_build
from pytest_circuits.model.families import attention_module
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.vocab import TokenInfo
from pytest_circuits.rungs.probe import (
    SCORES,
    RepeatProbe,
    routing_hooks,
    routing_scores,
    routing_sums,
    run_repeat_probe,
)
from pytest_circuits.rungs.repeat import repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import make_tiny_model

from .conftest import FAMILIES, needs_embedded, needs_smollm2

SMALL = RepeatSettings(seed=3, n=5, L=12)


@pytest.fixture(scope="module")
def tiny_build(tiny_folder):
    """``tiny_build(family, recipe="fp32")``: a loaded build of a tiny random model, memoised."""
    made = {}

    def make(family: str, recipe: str = "fp32"):
        if (family, recipe) not in made:
            made[family, recipe] = load_build(resolve_model(tiny_folder(family)), recipe, "cpu")
        return made[family, recipe]

    return make


def with_bos(build: LoadedBuild, bos_id: int) -> LoadedBuild:
    """The same build, but its tokenizer prepends ``bos_id`` (and calls it special)."""
    tokens = TokenInfo(build.tokens.vocab_size, (bos_id,), bos_id, True)
    return dataclasses.replace(build, tokens=tokens)


def loop_scores(pattern: torch.Tensor, L: int, offset: int) -> dict[str, np.ndarray]:
    """DEFINITIONS.md scores by explicit loops over sequences and destinations ``t`` of ``x x``."""
    A = pattern.double().numpy()
    n, heads = A.shape[:2]
    picks = {
        "prefix_matching": [(t, t - L + 1) for t in range(L, 2 * L)],
        "previous_token": [(t, t - 1) for t in range(1, 2 * L)],
        "duplicate_token": [(t, t - L) for t in range(L, 2 * L)],
    }
    out = {}
    for name, pairs in picks.items():
        total = np.zeros(heads)
        for b in range(n):
            for dst, src in pairs:
                total += A[b, :, offset + dst, offset + src]
        out[name] = total / (n * len(pairs))
    return out


def loop_losses(logits: torch.Tensor, ids: torch.Tensor, L: int, offset: int) -> tuple[float, float]:
    """(first-copy, copy) loss: mean -log p(token at o+t | prefix) over t in 1..L-1 and L+1..2L-1."""
    logp = torch.log_softmax(logits.double(), dim=-1)

    def mean_over(ts):
        return float(
            np.mean([-logp[b, offset + t - 1, ids[b, offset + t]].item() for b in range(len(ids)) for t in ts])
        )

    return mean_over(range(1, L)), mean_over(range(L + 1, 2 * L))


def random_pattern(n, heads, T, seed=0) -> torch.Tensor:
    """A causal, row-stochastic random attention pattern."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, heads, T, T, generator=g, dtype=torch.float64)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1)


def scores_array(probe: RepeatProbe, n_layers: int) -> np.ndarray:
    return np.stack([probe.heads[s].to_numpy().reshape(n_layers, -1) for s in SCORES], axis=1)


# --- the pure score reduction -------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 1])
def test_scores_of_a_random_pattern_match_the_definition(offset):
    L = 7
    pattern = random_pattern(3, 5, 2 * L + offset)
    got = routing_scores(pattern, L, offset)
    want = loop_scores(pattern, L, offset)
    for name in SCORES:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("offset", [0, 1])
def test_hand_built_heads_score_exactly(offset):
    """Head 0 attends to t-L+1, head 1 to t-1, head 2 to t-L (on the second copy), head 3 to itself."""
    L = 5
    T = 2 * L + offset
    A = torch.zeros(1, 4, T, T, dtype=torch.float64)
    for p in range(T):  # absolute positions; position o+t holds x-index t
        t = p - offset
        A[0, 3, p, p] = 1.0
        A[0, 1, p, p - 1 if t >= 1 else p] = 1.0
        A[0, 0, p, p - L + 1 if t >= L else p] = 1.0
        A[0, 2, p, p - L if t >= L else p] = 1.0
    got = routing_scores(A, L, offset)
    np.testing.assert_array_equal(got["prefix_matching"], [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(got["duplicate_token"], [0.0, 0.0, 1.0, 0.0])
    # head 0 looks back L-1 = 4 steps, never one; heads 2 and 3 never look one step back
    np.testing.assert_array_equal(got["previous_token"], [0.0, 1.0, 0.0, 0.0])


def test_bos_shifts_every_index_by_one():
    """With BOS at position 0, the scores are those of the pattern with BOS's row and column cut off."""
    L = 6
    pattern = random_pattern(2, 3, 2 * L + 1, seed=1)
    with_bos_scores = routing_scores(pattern, L, 1)
    cut_bos = routing_scores(pattern[:, :, 1:, 1:], L, 0)
    cut_last = routing_scores(pattern[:, :, :-1, :-1], L, 0)
    for name in SCORES:
        np.testing.assert_array_equal(with_bos_scores[name], cut_bos[name], err_msg=name)
        assert not np.allclose(with_bos_scores[name], cut_last[name]), name


def test_pattern_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="2L"):
        routing_scores(random_pattern(1, 2, 11), 5, 0)


# --- the probe on tiny random models -----------------------------------------------------


def output_attention_scores(build) -> np.ndarray:
    """``(n_layers, len(SCORES), n_heads)`` routing scores by the plain loop over the attention
    maps that ``output_attentions=True`` returns, on the SMALL probe's tokens."""
    ids = repeat_tokens(build.tokens, SMALL.n, SMALL.L, SMALL.seed)
    with torch.no_grad():
        out = build.model(input_ids=ids, output_attentions=True, use_cache=False)
    return np.stack([np.stack([loop_scores(a, SMALL.L, 0)[s] for s in SCORES]) for a in out.attentions])


@pytest.mark.parametrize("family", FAMILIES)
def test_hook_scores_equal_output_attentions(tiny_build, family):
    build = tiny_build(family)
    probe = run_repeat_probe(build, SMALL, batch_size=2)
    want = output_attention_scores(build)
    assert want.shape[0] == build.geometry.n_layers
    np.testing.assert_allclose(scores_array(probe, build.geometry.n_layers), want, rtol=0, atol=1e-6)
    assert list(probe.heads["head"][:2]) == ["L0H0", "L0H1"]
    assert probe.heads.shape[0] == build.geometry.n_layers * build.geometry.n_heads


@pytest.mark.parametrize("recipe", ["bnb-int8", "bnb-nf4"])
def test_hook_scores_equal_output_attentions_on_bitsandbytes(tiny_build, recipe):
    build = tiny_build("llama", recipe)
    probe = run_repeat_probe(build, SMALL, batch_size=3)
    want = output_attention_scores(build)
    np.testing.assert_allclose(scores_array(probe, build.geometry.n_layers), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_copy_losses_equal_a_plain_forward(tiny_build, family):
    build = tiny_build(family)
    probe = run_repeat_probe(build, SMALL, batch_size=2)
    ids = repeat_tokens(build.tokens, SMALL.n, SMALL.L, SMALL.seed)
    with torch.no_grad():
        logits = build.model(input_ids=ids).logits
    first, copy = loop_losses(logits, ids, SMALL.L, 0)
    assert probe.first_copy_loss == pytest.approx(first, abs=1e-5)
    assert probe.copy_loss == pytest.approx(copy, abs=1e-5)
    assert probe.copy_gain == pytest.approx(first - copy, abs=1e-5)
    assert probe.uniform_loss == pytest.approx(math.log(build.model.config.vocab_size))
    assert probe.model_figures() == {
        "copy_loss": probe.copy_loss,
        "first_copy_loss": probe.first_copy_loss,
        "copy_gain": probe.copy_gain,
        "uniform_loss": probe.uniform_loss,
    }
    assert probe.settings == SMALL and probe.bos_id is None


def test_bos_is_prepended_and_indices_shift(tiny_build):
    build = with_bos(tiny_build("gpt2"), bos_id=7)
    probe = run_repeat_probe(build, SMALL, batch_size=4)
    ids = repeat_tokens(build.tokens, SMALL.n, SMALL.L, SMALL.seed)
    assert ids.shape == (SMALL.n, 2 * SMALL.L + 1)
    assert (ids[:, 0] == 7).all() and not (ids[:, 1:] == 7).any()
    torch.testing.assert_close(ids[:, 1 : SMALL.L + 1], ids[:, SMALL.L + 1 :], rtol=0, atol=0)
    with torch.no_grad():
        out = build.model(input_ids=ids, output_attentions=True)
    first, copy = loop_losses(out.logits, ids, SMALL.L, 1)
    assert (probe.first_copy_loss, probe.copy_loss) == pytest.approx((first, copy), abs=1e-5)
    want = np.stack([np.stack([loop_scores(a, SMALL.L, 1)[s] for s in SCORES]) for a in out.attentions])
    np.testing.assert_allclose(scores_array(probe, build.geometry.n_layers), want, rtol=0, atol=1e-6)
    assert probe.bos_id == 7


def test_same_seed_same_tokens_and_figures(tiny_build):
    build = tiny_build("llama")
    a, b = run_repeat_probe(build, SMALL), run_repeat_probe(build, SMALL)
    assert a.model_figures() == b.model_figures()
    assert a.heads.equals(b.heads)
    t1 = repeat_tokens(build.tokens, SMALL.n, SMALL.L, SMALL.seed)
    assert torch.equal(t1, repeat_tokens(build.tokens, SMALL.n, SMALL.L, SMALL.seed))
    assert not torch.equal(t1, repeat_tokens(build.tokens, SMALL.n, SMALL.L, SMALL.seed + 1))
    other = run_repeat_probe(build, dataclasses.replace(SMALL, seed=SMALL.seed + 1))
    assert other.copy_loss != a.copy_loss


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_size_does_not_change_the_figures(tiny_build, family):
    build = tiny_build(family)
    whole = run_repeat_probe(build, SMALL, batch_size=SMALL.n)
    for batch_size in (1, 2):
        part = run_repeat_probe(build, SMALL, batch_size=batch_size)
        for key, value in whole.model_figures().items():
            assert part.model_figures()[key] == pytest.approx(value, abs=1e-6), key
        np.testing.assert_allclose(part.heads[list(SCORES)], whole.heads[list(SCORES)], rtol=0, atol=1e-6)


def test_too_long_for_the_context_is_refused_in_one_line(tiny_build):
    build = tiny_build("gpt2")  # n_positions = 128
    run_repeat_probe(build, RepeatSettings(seed=0, n=1, L=64))  # exactly fits
    with pytest.raises(CircuitsError) as info:
        run_repeat_probe(build, RepeatSettings(seed=0, n=1, L=65))
    message = str(info.value)
    assert "\n" not in message and "L=65" in message and "--circuits-probe-length 64" in message
    with pytest.raises(CircuitsError, match="--circuits-probe-length 63"):  # BOS takes one position
        run_repeat_probe(with_bos(build, 0), RepeatSettings(seed=0, n=1, L=64))


def test_sliding_window_scores_come_from_the_pattern_used(tiny_build, monkeypatch):
    """Mistral with a window shorter than L: nothing attends L back, so duplicate-token is exactly 0.

    The probe refuses such a length (`repeat.check_window`); with the refusal lifted, the scores
    still come from the masked pattern the model used."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from pytest_circuits.errors import CircuitsError
    from pytest_circuits.model.families import geometry_of
    from pytest_circuits.rungs import repeat

    torch.manual_seed(0)
    config = MistralConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=128,
        sliding_window=4,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    build = dataclasses.replace(tiny_build("llama"), model=model, geometry=geometry_of(model))
    with pytest.raises(CircuitsError, match="sliding window of 4 positions"):
        run_repeat_probe(build, SMALL, batch_size=2)
    monkeypatch.setattr(repeat, "check_window", lambda *args: None)
    probe = run_repeat_probe(build, SMALL, batch_size=2)
    ids = repeat_tokens(build.tokens, SMALL.n, SMALL.L, SMALL.seed)
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    want = np.stack([np.stack([loop_scores(a, SMALL.L, 0)[s] for s in SCORES]) for a in out.attentions])
    np.testing.assert_allclose(scores_array(probe, 2), want, rtol=0, atol=1e-6)
    assert (probe.heads["duplicate_token"] == 0).all() and (probe.heads["prefix_matching"] == 0).all()
    assert (probe.heads["previous_token"] > 0).all()


def test_attention_without_weights_is_refused(tiny_build):
    model = make_tiny_model("gpt2", seed=0)
    model.set_attn_implementation("sdpa")
    build = dataclasses.replace(tiny_build("gpt2"), model=model)
    with pytest.raises(CircuitsError, match="eager"):
        run_repeat_probe(build, SMALL)


def test_no_more_than_one_layer_of_attention_is_alive_at_once(tiny_build):
    """Count the attention maps alive when each layer's map appears: the hooks drop each one."""
    build = tiny_build("llama")
    model, n_layers = build.model, build.geometry.n_layers
    alive, most = [0], [0]

    def track(module, args, output):
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(output[1], lambda: alive.__setitem__(0, alive[0] - 1))

    handles = [attention_module(model, l).register_forward_hook(track) for l in range(n_layers)]
    ids = repeat_tokens(build.tokens, 2, SMALL.L, 0)
    try:
        with torch.no_grad(), routing_hooks(model, n_layers, SMALL.L, 0):
            out = model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert getattr(out, "attentions", None) is None
    assert most[0] == 1 and alive[0] == 0
    # the reference path does keep every layer's map
    with torch.no_grad():
        assert len(model(input_ids=ids, output_attentions=True).attentions) == n_layers


# --- the embedded and the real model ---------------------------------------------------------


@needs_embedded
def test_embedded_model_has_its_induction_and_previous_token_heads():
    build = load_build(resolve_model("tiny-induction"), "fp32", "cpu")
    probe = run_repeat_probe(build, RepeatSettings(seed=0, n=8, L=64))  # the CI defaults
    heads = probe.heads.set_index("head")
    induction = heads["prefix_matching"].idxmax()
    previous = heads["previous_token"].idxmax()
    assert heads.loc[induction, "layer"] == 1, heads.to_string()
    assert heads.loc[previous, "layer"] == 0, heads.to_string()
    assert heads.loc[induction, "prefix_matching"] > 0.5, heads.to_string()
    assert heads.loc[previous, "previous_token"] > 0.5, heads.to_string()
    assert probe.copy_loss < 0.5 * probe.first_copy_loss, probe.model_figures()


@pytest.mark.real
@needs_smollm2
def test_smollm2_copies_the_second_segment():
    build = load_build(resolve_model("smollm2-135m"), "fp32", "cpu")
    probe = run_repeat_probe(build, RepeatSettings(seed=0, n=2, L=64), batch_size=2)
    assert probe.copy_loss < 0.5 * probe.first_copy_loss, probe.model_figures()
    assert probe.copy_loss < probe.uniform_loss - 3, probe.model_figures()
    top = probe.heads.nlargest(1, "prefix_matching").iloc[0]
    assert top["prefix_matching"] > 0.5 and top["layer"] > 0, top.to_dict()


# --- a long probe in blocks of queries (rungs/query_blocks.py) ---------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block", [1, 5])
def test_blocks_of_queries_give_the_one_forward_figures(tiny_build, family, block):
    """Run through a DynamicCache, ``block`` queries at a time (1: a decode loop), the probe reads
    the same diagonals and losses as one forward over the whole sequence."""
    build = tiny_build(family)
    whole = run_repeat_probe(build, SMALL, batch_size=2)
    part = run_repeat_probe(build, SMALL, batch_size=2, block=block)
    assert whole.copy_losses is not None and part.copy_losses is not None
    np.testing.assert_allclose(part.copy_losses, whole.copy_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(part.first_copy_losses, whole.first_copy_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(part.position_loss, whole.position_loss, rtol=0, atol=1e-5)
    np.testing.assert_allclose(part.heads[list(SCORES)], whole.heads[list(SCORES)], rtol=0, atol=1e-6)
    np.testing.assert_allclose(part.heads["path_factor"], whole.heads["path_factor"], rtol=1e-6)


def test_blocks_of_queries_with_bos_give_the_one_forward_figures(tiny_build):
    build = with_bos(tiny_build("llama"), bos_id=7)
    whole, part = run_repeat_probe(build, SMALL), run_repeat_probe(build, SMALL, block=4)
    np.testing.assert_allclose(part.copy_losses, whole.copy_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(part.heads[list(SCORES)], whole.heads[list(SCORES)], rtol=0, atol=1e-6)
    np.testing.assert_allclose(part.heads["path_factor"], whole.heads["path_factor"], rtol=1e-6)


def test_a_block_of_queries_sums_its_rows_of_the_pattern():
    pattern = random_pattern(2, 3, 2 * 6 + 1)
    whole = routing_sums(pattern, 6, 1)
    for size in (1, 4, 13):
        blocks = [pattern[:, :, start : start + size, : start + size] for start in range(0, 13, size)]
        torch.testing.assert_close(sum(routing_sums(b, 6, 1) for b in blocks), whole, rtol=0, atol=1e-12)


def test_the_query_block_bounds_the_pattern_and_the_logits():
    from pytest_circuits.model.family_table import Geometry
    from pytest_circuits.rungs.query_blocks import BLOCK_BYTES, query_block

    one_b = Geometry(n_layers=16, n_heads=32, n_kv_heads=8, d_model=2048, d_head=64, vocab=128256)
    T = 8193
    c = query_block(one_b, 1, T)
    assert 1 <= c < T and 8 * 32 * c * T <= BLOCK_BYTES and 4 * c * 128256 <= BLOCK_BYTES
    tiny = Geometry(n_layers=2, n_heads=4, n_kv_heads=4, d_model=128, d_head=32, vocab=512)
    assert query_block(tiny, 8, 129) == 129  # the default probe: one forward, as before

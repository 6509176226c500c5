"""Rung 2 head knockouts: hooks, the replayed and batched scan, screening, and the gate's evidence."""

from __future__ import annotations

import copy
import math
import re
import time

import numpy as np
import pytest
import torch

from pytest_circuits.errors import CircuitsError
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.families import out_proj_module
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.run.plan import screen_variant
from pytest_circuits.rungs import knockout, replay
from pytest_circuits.rungs.ablation import ablated, parse_heads
from pytest_circuits.rungs.knockout import head_means, knockout_scan
from pytest_circuits.rungs.plain_loops import plain_knockout_deltas
from pytest_circuits.rungs.repeat import bos_offset, repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import requires_embedded_model, requires_smollm2, save_tiny_model

FAMILIES = ("gpt2", "gpt_neox", "llama")
HELD_OUT = RepeatSettings(seed=1, n=7, L=12)  # 7 sequences in chunks of 3: uneven chunks on purpose
needs_embedded = requires_embedded_model()


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """Tiny random models with large enough weights that every head's knockout moves the loss."""
    root = tmp_path_factory.mktemp("tiny")
    return {fam: save_tiny_model(fam, root / fam, seed=3, initializer_range=0.2) for fam in FAMILIES}


@pytest.fixture(scope="module")
def fp32_builds(tiny_folders):
    return {fam: load_build(resolve_model(str(folder)), "fp32", "cpu") for fam, folder in tiny_folders.items()}


def own_losses(model, ids, L, offset) -> tuple[float, float]:
    """``(first_copy_loss, copy_loss)`` written out independently, from one forward: mean CE of
    x[t] from logits[t-1] over t = offset+1 .. offset+L-1 and t = offset+L+1 .. offset+2L-1."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.double(), dim=-1)

    def mean_ce(t):
        return float(-logp[:, t - 1].gather(-1, ids[:, t].unsqueeze(-1)).mean())

    return mean_ce(torch.arange(offset + 1, offset + L)), mean_ce(torch.arange(offset + L + 1, offset + 2 * L))


def own_copy_loss(model, ids, L, offset) -> float:
    """Copy loss written out independently (see `own_losses`)."""
    return own_losses(model, ids, L, offset)[1]


def weight_surgery(build, layer, head, mean=None):
    """A copy of the model whose W_O rows of the head are zeroed (and mu_h W_O added to the bias)."""
    model = copy.deepcopy(build.model)
    proj = out_proj_module(model, layer)
    d = build.geometry.d_head
    cols = slice(head * d, (head + 1) * d)
    with torch.no_grad():
        if type(proj).__name__ == "Conv1D":  # weight (in, out): rows of the head
            w_head = proj.weight[cols, :].clone()
            proj.weight[cols, :] = 0
            contribution = None if mean is None else mean @ w_head
        else:  # nn.Linear (out, in): columns of the head
            w_head = proj.weight[:, cols].clone()
            proj.weight[:, cols] = 0
            contribution = None if mean is None else w_head @ mean
        if contribution is not None:
            if proj.bias is None:
                proj.bias = torch.nn.Parameter(torch.zeros(proj.out_features))  # nn.Linear without bias
            proj.bias += contribution
    return model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_hook_knockout_equals_weight_surgery(fp32_builds, family, mode):
    """The plain hook knockout gives the delta of editing W_O itself (independent of every hook)."""
    build = fp32_builds[family]
    ids = repeat_tokens(build.tokens, HELD_OUT.n, HELD_OUT.L, HELD_OUT.seed)
    offset = bos_offset(build.tokens)
    intact = own_copy_loss(build.model, ids, HELD_OUT.L, offset)
    heads = [(0, 1), (1, 3)]
    implementation = build.model.config._attn_implementation
    copy_loss, deltas = plain_knockout_deltas(build, HELD_OUT, mode=mode, heads=heads, batch_size=3)
    # the loop ran on SDPA; own_copy_loss and the probe run on the model's own (eager) attention
    assert build.model.config._attn_implementation == implementation == "eager"
    assert copy_loss == pytest.approx(intact, abs=1e-5)
    means = head_means(build, HELD_OUT, batch_size=3) if mode == "mean" else None
    for layer, head in heads:
        edited = weight_surgery(build, layer, head, None if means is None else means[layer, head])
        expected = own_copy_loss(edited, ids, HELD_OUT.L, offset) - intact
        assert abs(expected) > 2e-4, "the test model is too weak to show a knockout"
        assert deltas[f"L{layer}H{head}"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_mean_is_over_sequences_and_positions(fp32_builds, family):
    """Replacing z_h by its mean over every position and sequence keeps the batch mean of the projection's output."""
    build = fp32_builds[family]
    ids = repeat_tokens(build.tokens, HELD_OUT.n, HELD_OUT.L, HELD_OUT.seed)
    means = head_means(build, HELD_OUT, batch_size=3)
    layer, head = 1, 2
    outputs = []
    hook = out_proj_module(build.model, layer).register_forward_hook(lambda m, a, out: outputs.append(out.double()))
    try:
        with torch.no_grad():
            build.model(input_ids=ids, use_cache=False)
            with ablated(build.model, layer, build.geometry.d_head, [(slice(None), head)], means[layer]):
                build.model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    intact_out, ablated_out = outputs
    assert not torch.allclose(intact_out, ablated_out, atol=1e-4)  # the knockout did something
    torch.testing.assert_close(ablated_out.mean(dim=(0, 1)), intact_out.mean(dim=(0, 1)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_replayed_and_batched_scan_equals_the_plain_loop(fp32_builds, family, mode):
    build = fp32_builds[family]
    copy_loss, naive = plain_knockout_deltas(build, HELD_OUT, mode=mode, batch_size=3)
    for per_pass in (1, 3, None):
        df = knockout_scan(build, HELD_OUT, mode=mode, batch_size=3, knockouts_per_pass=per_pass, progress=False)
        assert df.attrs["copy_loss"] == pytest.approx(copy_loss, abs=1e-6)
        got = df.set_index("head")["knockout_delta"]
        assert set(got.index) == set(naive)
        worst = max(abs(got[h] - naive[h]) for h in naive)
        assert worst <= 1e-5, f"knockouts_per_pass={per_pass}: max |replayed - plain| = {worst:.2g}"
    plain = knockout_scan(build, HELD_OUT, mode=mode, batch_size=3, replay=False, progress=False)
    assert max(abs(plain.set_index("head")["knockout_delta"][h] - naive[h]) for h in naive) <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_bounded_record_recomputes_to_the_same_deltas(fp32_builds, family):
    """With room for fewer block inputs than layers, the replay recomputes the missing ones from
    the nearest kept input: the same deltas, bit for bit, as with every input kept."""
    build = fp32_builds[family]
    full = knockout_scan(build, HELD_OUT, batch_size=3, progress=False)
    n_tokens = HELD_OUT.n * (2 * HELD_OUT.L + bos_offset(build.tokens))
    one_block = n_tokens * build.geometry.d_model * 4
    assert replay.trace_stride(build, n_tokens, trace_bytes=10**12) == 1
    assert replay.trace_stride(build, n_tokens, trace_bytes=one_block) == build.geometry.n_layers
    for budget in (one_block, 2 * one_block):
        bounded = knockout_scan(build, HELD_OUT, batch_size=3, progress=False, trace_bytes=budget)
        assert bounded["knockout_delta"].tolist() == full["knockout_delta"].tolist(), budget
        assert bounded.attrs["replayed"] and bounded.attrs["copy_loss"] == full.attrs["copy_loss"]


def test_dataframe_contract(fp32_builds):
    build = fp32_builds["llama"]
    df = knockout_scan(build, HELD_OUT, progress=False)
    assert list(df.columns) == ["head", "layer", "head_index", "knockout_delta", "knockout_delta_sequences"]
    assert all(len(v) == HELD_OUT.n for v in df["knockout_delta_sequences"])  # averaging: tests/test_intervals.py
    geo = build.geometry
    assert len(df) == geo.n_layers * geo.n_heads
    assert df["head"].tolist() == [f"L{l}H{h}" for l in range(geo.n_layers) for h in range(geo.n_heads)]
    assert df["knockout_delta"].notna().all()
    assert df.attrs["mode"] == "zero" and df.attrs["settings"] == HELD_OUT.as_dict()
    assert df.attrs["screened"] is False and math.isfinite(df.attrs["copy_loss"])


@pytest.mark.parametrize("recipe", ["bnb-int8", "bnb-nf4"])
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_bnb_builds_knock_out_heads(tiny_folders, fp32_builds, recipe, mode):
    """Hooks work on quantized projections; the scan equals the plain loop; deltas track float32."""
    build = load_build(resolve_model(str(tiny_folders["llama"])), recipe, "cpu")
    assert type(out_proj_module(build.model, 0)).__name__ in ("Linear8bitLt", "Linear4bit")
    _, naive = plain_knockout_deltas(build, HELD_OUT, mode=mode, batch_size=3)
    df = knockout_scan(build, HELD_OUT, mode=mode, batch_size=3, progress=False)
    got = df.set_index("head")["knockout_delta"]
    assert max(abs(got[h] - naive[h]) for h in naive) <= 1e-5
    reference = knockout_scan(fp32_builds["llama"], HELD_OUT, mode=mode, batch_size=3, progress=False)
    ref = reference["knockout_delta"].to_numpy()
    assert np.abs(ref).max() > 0.05
    assert np.corrcoef(ref, df["knockout_delta"].to_numpy())[0, 1] > 0.8


@pytest.mark.parametrize("family", FAMILIES)
def test_scan_runs_on_sdpa_and_restores_eager(fp32_builds, family, monkeypatch):
    """Knockout forwards need no attention weights: they run on SDPA, and the model is eager again after."""
    build = fp32_builds[family]
    seen = []
    real = replay.forward_copy_losses

    def spy(model, *args):
        seen.append(model.config._attn_implementation)
        return real(model, *args)

    monkeypatch.setattr(replay, "forward_copy_losses", spy)
    knockout_scan(build, HELD_OUT, heads=["L1H0"], batch_size=3, progress=False)
    assert seen and set(seen) == {"sdpa"}
    assert build.model.config._attn_implementation == "eager"


def test_inexact_replay_falls_back_to_the_plain_loop(fp32_builds):
    """A model whose forward does more than its blocks and tail (here a hook on the decoder stack's
    output, as final-logit soft-capping would) cannot be replayed: one warning, then the plain loop."""
    build = fp32_builds["llama"]
    _, before = plain_knockout_deltas(build, HELD_OUT, heads=["L0H1", "L1H2"], batch_size=3)
    handle = build.model.model.register_forward_hook(
        lambda module, args, out: out.__class__(last_hidden_state=out.last_hidden_state * 1.5)
    )
    try:
        _, shifted = plain_knockout_deltas(build, HELD_OUT, heads=["L0H1", "L1H2"], batch_size=3)
        with pytest.warns(
            UserWarning, match="does not reproduce the model's copy loss .* running the plain loop"
        ) as info:
            df = knockout_scan(build, HELD_OUT, heads=["L0H1", "L1H2"], batch_size=3, progress=False)
    finally:
        handle.remove()
    assert len(info) == 1 and "\n" not in str(info[0].message)
    assert df.attrs["replayed"] is False
    got = df.set_index("head")["knockout_delta"]
    assert max(abs(got[h] - shifted[h]) for h in shifted) <= 1e-6
    assert max(abs(shifted[h] - before[h]) for h in shifted) > 1e-3  # the hook mattered


def test_int8_is_not_stacked_by_default(tiny_folders):
    build = load_build(resolve_model(str(tiny_folders["gpt2"])), "bnb-int8", "cpu")
    assert not replay.batch_invariant(build)
    assert knockout.auto_per_pass(build, None, 8, 8, 25) == 1


def test_cpu_stacks_knockouts_up_to_a_token_budget(fp32_builds):
    build = fp32_builds["llama"]
    budget = knockout.CPU_TOKENS_PER_PASS
    assert knockout.auto_per_pass(build, None, 8, 8, budget // 8 // 5) == 5
    assert knockout.auto_per_pass(build, None, 8, 8, budget // 8 * 3) == 1  # one knockout per pass at least
    assert knockout.auto_per_pass(build, 7, 8, 8, budget) == 7  # asked for: as asked


def test_subset_and_screening_agree_with_full_scan(fp32_builds):
    build = fp32_builds["gpt_neox"]
    full = knockout_scan(build, HELD_OUT, mode="mean", batch_size=3, progress=False).set_index("head")
    subset = knockout_scan(build, HELD_OUT, mode="mean", heads=["L1H0", (0, 2)], batch_size=3, progress=False)
    sub = subset.set_index("head")["knockout_delta"]
    assert sub.notna().sum() == 2
    for head in ("L1H0", "L0H2"):
        assert sub[head] == pytest.approx(full.loc[head, "knockout_delta"], abs=1e-6)
    screened = knockout_scan(
        build, HELD_OUT, mode="mean", screen_top_k=3, must_include=["L0H0"], batch_size=3, progress=False
    )
    scr = screened.set_index("head")
    score = scr["knockout_screen_score"]
    top = set(score.sort_values(ascending=False).index[:3])
    exact = set(scr.index[scr["knockout_delta"].notna()])
    assert exact == top | {"L0H0"}
    assert screened.attrs["screened"] and sorted(screened.attrs["exact_heads"]) == sorted(exact)
    for head in exact:
        assert scr.loc[head, "knockout_delta"] == pytest.approx(full.loc[head, "knockout_delta"], abs=1e-6)


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_attribution_estimate_is_the_directional_derivative(tiny_folders, mode):
    """estimate_h = d/de L(z_h + e (z_h^ablated - z_h)) at e = 0, checked by central differences in float64."""
    build = load_build(resolve_model(str(tiny_folders["llama"])), "fp32", "cpu")
    build.model.double()
    df = knockout_scan(build, HELD_OUT, mode=mode, screen_top_k=0, screen_method="atp", batch_size=3, progress=False)
    estimate = df.set_index("head")["knockout_estimate"]
    ids = repeat_tokens(build.tokens, HELD_OUT.n, HELD_OUT.L, HELD_OUT.seed)
    means = head_means(build, HELD_OUT) if mode == "mean" else None
    d = build.geometry.d_head
    eps = 1e-2  # eager attention runs its softmax in float32 even here: smaller steps drown in rounding

    def loss_at(layer, head, e):
        def hook(module, args):
            z = args[0].clone()
            part = z[..., head * d : (head + 1) * d]
            target = torch.zeros_like(part) if means is None else means[layer, head].to(z.dtype).expand_as(part)
            z[..., head * d : (head + 1) * d] = part + e * (target - part)
            return (z,)

        handle = out_proj_module(build.model, layer).register_forward_pre_hook(hook)
        try:
            return own_copy_loss(build.model, ids, HELD_OUT.L, bos_offset(build.tokens))
        finally:
            handle.remove()

    for layer, head in [(0, 0), (0, 3), (1, 1)]:
        numeric = (loss_at(layer, head, eps) - loss_at(layer, head, -eps)) / (2 * eps)
        assert estimate[f"L{layer}H{head}"] == pytest.approx(numeric, rel=1e-3, abs=1e-5)


def test_qk_fix_linear_term_is_the_derivative_of_its_exact_term(tmp_path, monkeypatch):
    """The QK fix subtracts the linearised pattern change, computed once per layer as a gradient
    and summed over later layers (`screen._qk_fix`). It must be ``d/de`` of the exact pattern
    change of ``r_m + e dr_h`` summed over every later layer, checked by central differences on a
    4-layer model in float64, every head of every source layer."""
    from pytest_circuits.rungs import screen

    folder = save_tiny_model("llama", tmp_path / "m", seed=5, num_hidden_layers=4, initializer_range=0.2)
    build = load_build(resolve_model(str(folder)), "fp32", "cpu")
    build.model.double()
    geo, eps, checked = build.geometry, 3e-3, []
    original = screen._qk_fix

    def checking(build, qk_term, dzs, residual, calls, norms, attn, rows, qk_heads=None):
        before = qk_term.clone()
        original(build, qk_term, dzs, residual, calls, norms, attn, rows, qk_heads)
        for layer in range(geo.n_layers - 1):
            dr = screen._output_change(build, layer, dzs[layer].detach())
            exact, plus, minus = (
                screen.exact_pattern_change(build, layer, step * dr, residual, calls, norms, attn, rows)
                for step in (1, eps, -eps)
            )
            numeric = (plus - minus) / (2 * eps)
            added = qk_term[layer] - before[layer]  # exact - linear, per head of the layer
            # the family's RMSNorm runs in float32 even here: the steps' rounding bounds the agreement
            worst = float((added - (exact - numeric)).abs().max())
            assert worst <= 1e-3 * float(numeric.abs().max()) + 1e-7, (layer, added, exact - numeric)
            checked.append(layer)

    monkeypatch.setattr(screen, "_qk_fix", checking)
    df = knockout_scan(build, HELD_OUT, screen_top_k=0, batch_size=7, progress=False)
    assert df.attrs["screen_method"] == "atp*" and checked == [0, 1, 2]


def _screen(build, variant=None, method="atp*", mode="zero"):
    df = knockout_scan(
        build,
        HELD_OUT,
        mode=mode,
        screen_top_k=0,
        screen_method=method,
        batch_size=3,
        progress=False,
        screen_variant=variant,
    )
    return df["knockout_estimate"].to_numpy(), df["knockout_screen_score"].to_numpy()


@pytest.mark.parametrize("method", ["atp*", "atp*gd", "atp"])
def test_screen_variant_at_todays_values_is_todays_screen_exactly(fp32_builds, method):
    """Every knob of `ScreenVariant` set to what today's screen does (all sequences, the QK fix on
    every head, GradDrop on every block, the scan's own ablation) gives today's numbers bit for bit."""
    from pytest_circuits.rungs.screen import ScreenVariant

    build = fp32_builds["llama"]
    geo = build.geometry
    today = _screen(build, None, method)
    same = ScreenVariant(
        sequences=HELD_OUT.n, qk_top=geo.n_layers * geo.n_heads, grad_drop_layers=geo.n_layers - 1, ablation="scan"
    )
    for got, want in zip(_screen(build, same, method), today):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("method", ["atp*", "atp*gd"])
def test_qk_fix_in_groups_of_heads_is_the_qk_fix_of_every_head_at_once(fp32_builds, method, monkeypatch):
    """The QK fix stacks a layer's heads in groups that fit `screen.QK_FIX_BYTES` (what bounds its
    memory at 1B+): one head at a time gives the estimates of every head stacked at once."""
    from pytest_circuits.rungs import screen

    build = fp32_builds["llama"]
    at_once = _screen(build, None, method)
    monkeypatch.setattr(screen, "QK_FIX_BYTES", 1)  # groups of one head
    for got, want in zip(_screen(build, None, method), at_once):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_screen_variant_knobs_do_what_they_say(fp32_builds):
    """``qk_top=0`` leaves every head its plain AtP estimate; ``qk_top=C`` changes exactly C heads'
    estimates from AtP's (AtP's top C by |estimate|); ``ablation="both"`` is the mean of the zero-
    and mean-ablation screens; ``sequences`` changes the estimate (fewer sequences)."""
    from pytest_circuits.rungs.screen import ScreenVariant

    build = fp32_builds["llama"]
    atp = _screen(build, None, "atp")[0]
    star = _screen(build, None, "atp*")[0]
    np.testing.assert_allclose(_screen(build, ScreenVariant(qk_top=0))[0], atp, rtol=1e-5, atol=1e-8)
    partial = _screen(build, ScreenVariant(qk_top=3))[0]
    fixed = ~np.isclose(partial, atp, rtol=1e-5, atol=1e-8)
    top3 = np.argsort(-np.abs(atp), kind="stable")[:3]
    assert set(np.flatnonzero(fixed)) <= set(top3) and fixed.sum() >= 1
    np.testing.assert_allclose(partial[fixed], star[fixed], rtol=1e-5, atol=1e-8)
    both = _screen(build, ScreenVariant(ablation="both"), "atp")
    zero, mean = _screen(build, None, "atp", "zero"), _screen(build, None, "atp", "mean")
    np.testing.assert_allclose(both[0], (zero[0] + mean[0]) / 2, rtol=1e-6)
    np.testing.assert_allclose(both[1], (zero[1] + mean[1]) / 2, rtol=1e-6)
    fewer = _screen(build, ScreenVariant(sequences=2), "atp")[0]
    assert not np.allclose(fewer, atp)


def test_grad_drop_blocks_sample_spreads_evenly():
    from pytest_circuits.rungs.screen import grad_drop_blocks

    assert grad_drop_blocks(30, None) == list(range(1, 30))
    assert grad_drop_blocks(30, 4) == [1, 10, 20, 29]  # blocks 1..29 at steps of 28/3, rounded
    assert grad_drop_blocks(3, 9) == [1, 2]
    assert grad_drop_blocks(30, 1) == [1]


@pytest.mark.parametrize(
    "knobs, named",
    [
        (dict(sequences=0), "--circuits-knockout-screen-sequences 0 must be at least 1"),
        (dict(qk_top=-1), "--circuits-knockout-screen-qk-top -1 must be at least 0"),
        (dict(grad_drop_layers=0), "--circuits-knockout-screen-grad-drop-layers 0 must be at least 1"),
        (dict(ablation="half"), "--circuits-knockout-screen-ablation 'half' is unknown; use one of: scan, both"),
    ],
)
def test_screen_variant_refuses_bad_knobs_in_one_line(fp32_builds, knobs, named):
    from pytest_circuits.rungs.screen import ScreenVariant

    with pytest.raises(CircuitsError) as info:
        knockout_scan(
            fp32_builds["gpt2"], HELD_OUT, screen_top_k=1, progress=False, screen_variant=ScreenVariant(**knobs)
        )
    assert str(info.value) == named


def test_screening_falls_back_to_exact_when_backward_fails(fp32_builds, monkeypatch):
    build = fp32_builds["gpt2"]
    from pytest_circuits.rungs import screen

    def no_backward(*args, **kwargs):
        raise RuntimeError("backward is not implemented for this layer")

    monkeypatch.setattr(screen, "screen_estimate", no_backward)
    with pytest.warns(UserWarning, match="running exact knockouts on every requested head"):
        df = knockout_scan(build, HELD_OUT, screen_top_k=2, progress=False)
    assert not df.attrs["screened"] and "knockout_estimate" not in df
    assert df["knockout_delta"].notna().all()


@pytest.mark.parametrize("method", ["atp", "atp*"])
def test_screening_falls_back_when_kernels_run_outside_autograd(fp32_builds, method):
    """bitsandbytes 4-bit runs its CPU matmul outside autograd: no gradient reaches the heads
    before it. Simulated by detaching layer 0's output projection; one warning names the layer."""
    build = fp32_builds["llama"]
    handle = out_proj_module(build.model, 0).register_forward_hook(lambda module, args, out: out.detach())
    try:
        with pytest.warns(UserWarning, match="no gradient reached the head outputs of layer 0") as seen:
            df = knockout_scan(build, HELD_OUT, screen_top_k=2, screen_method=method, progress=False)
    finally:
        handle.remove()
    assert len(seen) == 1 and "\n" not in str(seen[0].message)
    assert not df.attrs["screened"] and df["knockout_delta"].notna().all()


def test_user_errors_are_one_line(fp32_builds):
    build = fp32_builds["gpt2"]
    cases = [
        dict(mode="resample"),
        dict(heads=["layer1head2"]),
        dict(heads=["L9H0"]),
        dict(screen_top_k=-1),
        dict(knockouts_per_pass=0),
    ]
    for kwargs in cases:
        with pytest.raises(CircuitsError) as info:
            knockout_scan(build, HELD_OUT, progress=False, **kwargs)
        assert "\n" not in str(info.value)
    with pytest.raises(CircuitsError, match="context"):
        knockout_scan(build, RepeatSettings(seed=1, n=2, L=100), progress=False)
    assert parse_heads(["L1H0", "L0H3", (1, 0)], build.geometry) == [(0, 3), (1, 0)]


def test_session_head_knockout(tiny_folders, capsys):
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    settings = CircuitsSettings(
        model=str(tiny_folders["gpt2"]), builds=("fp32",), device="cpu", probe=RepeatSettings(seed=0, n=3, L=8)
    )
    df = Run(settings).measured.head_knockout("fp32")
    assert df.attrs["settings"]["seed"] == settings.knockout_probe.seed != settings.probe.seed
    assert df["knockout_delta"].notna().all()
    assert capsys.readouterr().err == ""  # the progress bar stays off when stderr is not a terminal


# --- the embedded model: the induction head is the one copying depends on ---


@pytest.fixture(scope="module")
def embedded_build():
    return load_build(resolve_model("tiny-induction"), "fp32", "cpu")


def circuit_heads(build, settings):
    """``(induction, previous, scores)``: the top prefix-matching and top previous-token heads as
    ``(layer, head)``, and the routing scores they were picked from."""
    scores = routing_scores_of(build, settings)
    n_heads = build.geometry.n_heads
    induction = divmod(int(scores["prefix_matching"].argmax()), n_heads)
    previous = divmod(int(scores["previous_token"].argmax()), n_heads)
    return induction, previous, scores


@needs_embedded
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_embedded_induction_head_knockout_dominates(embedded_build, mode):
    """The induction head, found by prefix matching on the probe seed, is what copying rests
    on: knocked out on held-out sequences it raises copy loss by nats, far more than any
    head outside the circuit. The only head that comes close is the previous-token head
    it reads from (found by its own score): a two-layer induction circuit has two single
    points of failure, and both are named here."""
    (il, ih), (pl, ph), scores = circuit_heads(embedded_build, RepeatSettings(seed=0, n=16, L=32))
    assert il == 1 and scores["prefix_matching"][il, ih] > 0.5, scores
    assert pl == 0 and scores["previous_token"][pl, ph] > 0.5, scores
    df = knockout_scan(embedded_build, RepeatSettings(seed=1, n=16, L=32), mode=mode, progress=False)
    deltas = df.set_index("head")["knockout_delta"]
    induction, previous = f"L{il}H{ih}", f"L{pl}H{ph}"
    outside = deltas.drop([induction, previous])
    assert deltas[induction] > 3.0, deltas.to_string()
    assert deltas[induction] > 5 * outside.max(), deltas.to_string()
    assert deltas[previous] > 3.0, deltas.to_string()  # the circuit's other half
    same_layer = deltas[[f"L{il}H{h}" for h in range(embedded_build.geometry.n_heads) if h != ih]]
    assert deltas[induction] > 20 * same_layer.abs().max(), deltas.to_string()  # no backup induction head


@needs_embedded
def test_embedded_circuit_is_two_heads(embedded_build):
    """Written independently of the scan (weight surgery, own loss): knocking out every head
    outside the induction circuit at once leaves copying working, while the induction head
    alone breaks it."""
    probe = RepeatSettings(seed=0, n=16, L=32)
    (il, ih), (pl, ph), scores = circuit_heads(embedded_build, probe)
    held_out = RepeatSettings(seed=1, n=16, L=32)
    ids = repeat_tokens(embedded_build.tokens, held_out.n, held_out.L, held_out.seed)
    offset = bos_offset(embedded_build.tokens)
    first_copy, intact = own_losses(embedded_build.model, ids, held_out.L, offset)
    geometry = embedded_build.geometry

    def loss_without(heads):
        model = copy.deepcopy(embedded_build.model)
        with torch.no_grad():
            for layer, head in heads:  # zero the head's columns of W_O: no hooks involved
                out_proj_module(model, layer).weight[:, head * geometry.d_head : (head + 1) * geometry.d_head] = 0
        return own_copy_loss(model, ids, held_out.L, offset)

    others = [
        (lay, h)
        for lay in range(geometry.n_layers)
        for h in range(geometry.n_heads)
        if (lay, h) not in {(il, ih), (pl, ph)}
    ]
    without_induction = loss_without([(il, ih)])
    without_others = loss_without(others)
    assert intact < 0.1 * first_copy, (intact, first_copy)
    assert without_induction > 0.5 * first_copy, (without_induction, first_copy)
    assert without_others - intact < 0.2 * (without_induction - intact), (without_others, without_induction, intact)


def routing_scores_of(build, settings):
    """Prefix-matching and previous-token scores per head, (n_layers, n_heads), from output_attentions."""
    ids = repeat_tokens(build.tokens, settings.n, settings.L, settings.seed)
    offset, L = bos_offset(build.tokens), settings.L
    with torch.no_grad():
        attentions = build.model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    dest = torch.arange(offset + L, offset + 2 * L)
    everywhere = torch.arange(offset + 1, offset + 2 * L)
    return {
        "prefix_matching": torch.stack([a[:, :, dest, dest - L + 1].mean(dim=(0, 2)) for a in attentions]).float(),
        "previous_token": torch.stack(
            [a[:, :, everywhere, everywhere - 1].mean(dim=(0, 2)) for a in attentions]
        ).float(),
    }


@needs_embedded
def test_embedded_screen_keeps_must_include_heads_exact(embedded_build):
    """Plain attribution patching misses saturated heads: on the embedded model the previous-token
    head's first-order estimate is near zero while its exact knockout is several nats, because
    the induction head's attention moves between saturated keys. The screen therefore always
    knocks out the baseline's key heads (``must_include``) exactly, whatever their estimate."""
    held_out = RepeatSettings(seed=1, n=16, L=32)
    full = knockout_scan(embedded_build, held_out, progress=False).set_index("head")["knockout_delta"]
    previous = "L0H1"
    assert full[previous] > 3.0, full.to_string()
    screened = knockout_scan(
        embedded_build, held_out, screen_top_k=1, screen_method="atp", must_include=[previous], progress=False
    ).set_index("head")
    assert abs(screened.loc[previous, "knockout_estimate"]) < 0.1 * full[previous]  # AtP alone would miss it
    assert screened.loc[previous, "knockout_delta"] == pytest.approx(full[previous], abs=1e-5)
    top_estimate = screened["knockout_screen_score"].idxmax()
    assert set(screened.index[screened["knockout_delta"].notna()]) == {top_estimate, previous}


@needs_embedded
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_embedded_atp_star_ranks_both_circuit_heads_first(embedded_build, mode):
    """AtP*'s QK fix recomputes the induction head's softmax for the previous-token head's change
    of its keys: both circuit heads (their exact deltas are the two largest) lead its ranking."""
    held_out = RepeatSettings(seed=1, n=16, L=32)
    full = knockout_scan(embedded_build, held_out, mode=mode, progress=False).set_index("head")["knockout_delta"]
    circuit = set(full.abs().sort_values(ascending=False).index[:2])
    assert circuit == {"L1H0", "L0H1"}, full.to_string()
    screened = knockout_scan(embedded_build, held_out, mode=mode, screen_top_k=4, progress=False).set_index("head")
    assert screened.attrs["screen_method"] == "atp*"
    top4 = set(screened["knockout_screen_score"].sort_values(ascending=False).index[:4])
    assert circuit <= top4, screened.to_string()
    assert screened.loc["L0H1", "knockout_estimate"] > 0.5 * screened.loc["L1H0", "knockout_estimate"] > 0


@needs_embedded
@pytest.mark.parametrize("qk_top", [None, 2])
def test_embedded_default_screen_ranks_both_circuit_heads_first(embedded_build, qk_top):
    """The default screen (`DEFAULT_SCREEN_QK_TOP`: at least the embedded model's 8 heads, so its full
    QK fix) and the QK fix on AtP's top 2 only both rank the exact top 2 heads (the circuit) in their top 2."""
    from pytest_circuits.options import DEFAULT_SCREEN_QK_TOP
    from pytest_circuits.rungs.screen import ScreenVariant

    held_out = RepeatSettings(seed=1, n=16, L=32)
    full = knockout_scan(embedded_build, held_out, progress=False).set_index("head")["knockout_delta"]
    exact_top = set(full.sort_values(ascending=False).index[:2])
    variant = ScreenVariant(qk_top=DEFAULT_SCREEN_QK_TOP if qk_top is None else qk_top)
    screened = knockout_scan(embedded_build, held_out, screen_top_k=2, progress=False, screen_variant=variant)
    score = screened.set_index("head")["knockout_screen_score"]
    assert set(score.sort_values(ascending=False).index[:2]) == exact_top, score.to_string()


# --- the real model ---


@pytest.fixture(scope="module")
def smollm2():
    return load_build(resolve_model("smollm2-135m"), "fp32", "cpu")


@requires_smollm2()
@pytest.mark.real
def test_smollm2_strongest_induction_head_knockout(smollm2):
    probe = RepeatSettings(seed=0, n=4, L=24)
    scores = routing_scores_of(smollm2, probe)["prefix_matching"]
    order = scores.flatten().argsort(descending=True)
    n_heads = scores.shape[1]
    top = [divmod(int(i), n_heads) for i in order[:3]]
    # controls: the least prefix-matching heads of the same layers (same depth, same downstream path)
    controls = []
    for layer in sorted({l for l, _ in top}):
        controls.append((layer, int(scores[layer].argmin())))
    strongest = top[0]
    df = knockout_scan(smollm2, RepeatSettings(seed=1, n=4, L=24), heads=top + controls, progress=False)
    deltas = df.set_index("head")["knockout_delta"]
    label = f"L{strongest[0]}H{strongest[1]}"
    control_deltas = [deltas[f"L{l}H{h}"] for l, h in controls]
    report = f"{label}: {deltas[label]:+.3f}; controls " + ", ".join(
        f"L{l}H{h} {d:+.3f}" for (l, h), d in zip(controls, control_deltas)
    )
    print(report)
    assert deltas[label] > 0.5, report
    assert deltas[label] > 5 * max(abs(d) for d in control_deltas), report


def _session_of(folder, **settings):
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    probe = RepeatSettings(seed=0, n=2, L=6)
    base = dict(model=str(folder), builds=("fp32",), reference="fp32", device="cpu", probe=probe)
    return Run(CircuitsSettings(**{**base, **settings}))


def _wide_model(tmp_path):
    """A tiny llama of 304 heads (4 layers x 76): past the 300 heads from which the plan screens."""
    return save_tiny_model(
        "llama",
        tmp_path / "wide",
        num_hidden_layers=4,
        num_attention_heads=76,
        num_key_value_heads=4,
        hidden_size=304,
        intermediate_size=64,
    )


def test_default_plan_screens_past_300_heads_and_says_so_first(tmp_path):
    """More than 300 heads: rung 2 screens by default (top 12 exact), printing the plan and its
    counted time before it starts; --knockout-full asks for every head; 300 or fewer stay exact."""
    from pytest_circuits.run.plan import AUTO_SCREEN_TOP_K
    from pytest_circuits.rungs.plan import exact_flops, planned_heads, screen_flops

    wide = _wide_model(tmp_path)
    session = _session_of(wide, knockout_screen_method="atp")
    assert session.measured.screen_top_k() == AUTO_SCREEN_TOP_K == 12
    lines: list[str] = []
    session.loaded.progress_write = lines.append
    frame = session.measured.head_knockout("fp32")
    plan = [line for line in lines if line.startswith("circuits: rung 2 of")]
    assert len(plan) == 1 and "304 heads" in plan[0] and "the atp screen over every head" in plan[0]
    assert "the full exact scan only with --circuits-knockout-full" in plan[0] and "GFLOP/s" in plan[0]
    scan_lines = [line for line in lines if not line.startswith("loading ")]  # a slow load may beat first
    assert scan_lines.index(plan[0]) == 0  # before any progress of the scan
    took = [line for line in lines if " took " in line]  # and after it, the time beside the estimate
    assert len(took) == 1 and scan_lines.index(took[0]) == len(scan_lines) - 1
    # beside the estimate for the heads the screen chose; the plan before it had counted layer 0's
    assert re.search(r"of wall time; the plan estimated .+ \(\d+\.\d\dx\) for the heads knocked out", took[0])
    assert frame.attrs["screened"] and len(frame.attrs["exact_heads"]) == 12
    assert frame["knockout_delta"].notna().sum() == 12
    build, probe = session.loaded.build("fp32"), session.settings.knockout_probe
    top = planned_heads(build, probe, 12)  # counted at the longest replays: layer 0's
    assert top == [(0, h) for h in range(12)]
    assert screen_flops(build, probe, "atp") + exact_flops(build, probe, top) < exact_flops(build, probe) / 5
    assert _session_of(wide, knockout_full=True).measured.screen_top_k() is None
    assert _session_of(wide, knockout_screen=5).measured.screen_top_k() == 5
    with pytest.raises(CircuitsError, match="contradict each other; give one"):
        _session_of(wide, knockout_full=True, knockout_screen=5).measured.screen_top_k()
    narrow = save_tiny_model("llama", tmp_path / "narrow")
    assert _session_of(narrow).measured.screen_top_k() is None  # the embedded model, SmolLM2: every head exactly


def test_a_scan_planned_by_size_says_its_whole_cost_first_and_its_time_last(tmp_path):
    """Past 300 heads a build's whole scan (rung 1, the probe, rung 2) says its counted cost and time
    before rung 1 starts and its wall time beside that estimate after rung 2; without knockouts the
    line counts no rung 2; a model scanned exactly (300 heads or fewer) says neither."""
    from pytest_circuits.rungs.plan import probe_flops, rung1_flops

    wide = _wide_model(tmp_path)
    for with_knockout in (True, False):
        session = _session_of(wide, knockout_screen_method="atp")
        lines: list[str] = []
        session.loaded.progress_write = lines.append
        session.records.record("fp32", knockout=with_knockout)
        said = [line for line in lines if not line.startswith(("loading ", "rung 1 (", "repeat probe ("))]
        scan = [line for line in said if line.startswith("circuits: the scan of")]
        took = [line for line in said if "the scan took" in line]
        assert len(scan) == 1 and len(took) == 1, said
        assert said.index(scan[0]) == 0 and said.index(took[0]) == len(said) - 1, said
        assert ("; rung 2 " in scan[0]) is with_knockout and "rung 1 counts" in scan[0]
        assert "(products in float32 at " in scan[0] and ", eigenvalues " in scan[0]
        assert re.search(r"the plan estimated .+ \(\d+\.\d\dx\)", took[0]), took[0]
        assert ("for the heads knocked out" in took[0]) is with_knockout, took[0]
        build = session.loaded.build("fp32")
        rung1 = rung1_flops(build.geometry, session.settings.kappa_method.n_rotations)
        assert f"rung 1 counts {rung1 / 1e12:.3g} TFLOP" in scan[0]
        assert f"the probe {probe_flops(build, session.settings.probe) / 1e12:.3g}" in scan[0]
    narrow = _session_of(save_tiny_model("llama", tmp_path / "narrow"))
    lines = []
    narrow.loaded.progress_write = lines.append
    narrow.records.record("fp32")
    assert not [line for line in lines if "the scan" in line]


def test_rung_1s_eigenvalues_are_planned_at_the_rate_one_heads_null_runs_here(monkeypatch):
    """Rung 1's eigenvalue problems run far below a matmul's rate (LAPACK, one small matrix at a time),
    so the plan times one head's null (`kappa_null.rotation_null`) once per shape and counts every
    head's null and its two own spectra at that time per matrix, over the null's threads."""
    from types import SimpleNamespace

    import pytest_circuits.rungs.kappa_null as kappa_null
    import pytest_circuits.rungs.plan as plan

    calls: list[tuple[int, ...]] = []
    timed = kappa_null.rotation_null

    def counted(M, rotations, dtype):
        calls.append(tuple(rotations.shape))
        return timed(M, rotations, dtype)

    monkeypatch.setattr(kappa_null, "rotation_null", counted)
    monkeypatch.setattr(plan, "_EIGEN", {})
    monkeypatch.setattr(kappa_null, "default_workers", lambda: 2)
    geo = SimpleNamespace(n_layers=3, n_heads=4, d_head=16)
    first = plan.eigen_seconds(geo, 8, torch.float32)
    assert plan.eigen_seconds(geo, 8, torch.float32) == first  # timed once per shape
    assert calls == [(8, 16, 16), (8, 16, 16)]  # a warm-up and the timed null of one head
    one_head = plan._EIGEN[(16, 8, torch.float32)]
    assert first == pytest.approx(12 * one_head * (1 + 2 / 8) / 2, rel=1e-12)
    assert plan.eigen_flops(geo, 8) == 12 * 10 * 27 * 16**3


def test_automatic_screen_method_is_chosen_by_counted_cost_and_said(tmp_path, monkeypatch):
    """``auto`` (the default) screens with atp* while its counted FLOPs fit the device's budget, and
    with atp past it, saying so in one line first; the record names the method that ran; an explicit
    method is kept whatever it costs."""
    import pytest_circuits.rungs.plan as plan

    folder = save_tiny_model("llama", tmp_path / "m")
    session = _session_of(folder, knockout_screen=2)
    assert session.settings.knockout_screen_method == "auto"
    build, probe = session.loaded.build("fp32"), session.settings.knockout_probe
    atp_star = plan.screen_flops(build, probe, "atp*")
    assert plan.screen_flops(build, probe, "atp") < atp_star
    assert plan.automatic_screen_method(build, probe) == ("atp*", "")  # a tiny model fits any budget
    monkeypatch.setitem(plan.SCREEN_BUDGET_FLOP, "cpu", atp_star / 2)
    method, why = plan.automatic_screen_method(build, probe)
    assert method == "atp" and "over the cpu budget" in why and "--knockout-screen-method atp*" in why
    monkeypatch.delitem(plan.SCREEN_BUDGET_FLOP, "cpu")  # a device without a budget (CUDA)
    assert plan.automatic_screen_method(build, probe)[0] == "atp*"
    monkeypatch.setitem(plan.SCREEN_BUDGET_FLOP, "cpu", atp_star / 2)

    lines: list[str] = []
    session.loaded.progress_write = lines.append
    frame = session.measured.head_knockout("fp32")
    assert frame.attrs["screen_method"] == "atp"
    assert sum("screening with atp" in line for line in lines) == 1
    record = session.records.record("fp32")
    assert record.knockout.model_extra["screen_method"] == "atp"
    explicit = _session_of(folder, knockout_screen=2, knockout_screen_method="atp*")
    assert explicit.measured.head_knockout("fp32").attrs["screen_method"] == "atp*"


def test_screen_variant_reaches_the_scan_and_its_count(tmp_path, monkeypatch):
    """The ``--knockout-screen-*`` settings reach the screen, and the counted cost that picks the
    automatic method counts the variant: fewer sequences and the QK fix on fewer heads count less."""
    import pytest_circuits.rungs.plan as plan
    from pytest_circuits.options import DEFAULT_SCREEN_QK_TOP
    from pytest_circuits.rungs import screen
    from pytest_circuits.rungs.screen import ScreenVariant
    from pytest_circuits.settings import recording_words

    folder = save_tiny_model("llama", tmp_path / "m", num_hidden_layers=4)
    session = _session_of(folder, knockout_screen=2, knockout_screen_sequences=1, knockout_screen_qk_top=1)
    build, probe = session.loaded.build("fp32"), session.settings.knockout_probe
    today = plan.screen_flops(build, probe, "atp*")
    assert plan.screen_flops(build, probe, "atp*", ScreenVariant()) == today
    assert plan.screen_flops(build, probe, "atp*", ScreenVariant(sequences=1)) == pytest.approx(today / probe.n)
    atp = plan.screen_flops(build, probe, "atp")  # qk_top adds one plain AtP pass; its QK fix counts less
    assert plan.screen_flops(build, probe, "atp*", ScreenVariant(qk_top=1)) - 2 * atp < today - atp
    assert plan.screen_flops(build, probe, "atp", ScreenVariant(ablation="both")) == pytest.approx(
        2 * plan.screen_flops(build, probe, "atp")
    )
    seen = []
    original = screen.screen_estimate

    def spy(build, ids, L, mode, means, method, batch_size, bar=None, variant=screen.TODAY):
        seen.append((ids.shape[0], variant))
        return original(build, ids, L, mode, means, method, batch_size, bar, variant)

    monkeypatch.setattr(screen, "screen_estimate", spy)
    session.measured.head_knockout("fp32")
    assert seen == [(probe.n, ScreenVariant(sequences=1, qk_top=1))]
    default = _session_of(folder, knockout_screen=2)
    assert screen_variant(default.settings) == ScreenVariant(qk_top=DEFAULT_SCREEN_QK_TOP)
    assert not any("qk-top" in word for word in recording_words(default.settings, "cli"))


def test_the_plan_times_one_pass_of_each_kind_once(tmp_path):
    """#55: the plan's rates are the build's own passes timed now (`calibrated_rate`): a forward of the
    probe's first rows, a forward of a stacked replay's sequences, the atp screen on one sequence;
    each its counted FLOPs over its wall time, measured once per build; `rung2_seconds` adds the
    stage's counted passes, each kind at its rate."""
    from pytest_circuits.model.hooks import hooked
    from pytest_circuits.rungs.knockout import auto_per_pass
    from pytest_circuits.rungs.plan import (
        CALIBRATION_ROWS,
        KINDS,
        calibrated_rate,
        exact_seconds,
        knockout_flops,
        probe_flops,
        replay_flops,
        rung2_seconds,
        screen_flops,
    )

    session = _session_of(_wide_model(tmp_path), knockout_screen_method="atp")
    build, probe = session.loaded.build("fp32"), session.settings.knockout_probe
    shapes: list[tuple[int, ...]] = []
    rates, took = {}, {}
    with hooked(
        (build.model, "pre_kwargs", lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)))
    ):
        for kind in KINDS:
            started = time.perf_counter()
            rates[kind] = calibrated_rate(build, probe, kind)
            took[kind] = time.perf_counter() - started
            assert calibrated_rate(build, probe, kind) == rates[kind]  # the second plan of this build reuses it
    T = 2 * probe.L + (build.tokens.bos_id is not None)
    rows = min(CALIBRATION_ROWS, probe.n)
    stacked = auto_per_pass(build, None, rows, probe.n, T)
    assert stacked > 1  # the wide model's replays stack knockouts: a pass of its own size is timed
    # a warm-up of one sequence, the timed rows and the stacked replay's rows each twice (a pass under
    # RETIME_BELOW_S), the screen's warm-up and timed sequence
    assert shapes == [(1, T), (rows, T), (rows, T), (rows * stacked, T), (rows * stacked, T), (1, T), (1, T)]
    for kind, n in (("forward", rows), ("replay", rows * stacked)):  # each timed pass took less than its call
        assert probe_flops(build, type(probe)(seed=probe.seed, n=n, L=probe.L)) / took[kind] <= rates[kind]
    one = type(probe)(seed=probe.seed, n=1, L=probe.L)
    assert screen_flops(build, one, "atp") / took["screen"] <= rates["screen"] < float("inf")
    counted = knockout_flops(build, probe)
    heads = build.geometry.n_layers * build.geometry.n_heads
    by_layer = replay_flops(build, probe)
    assert by_layer == sorted(by_layer, reverse=True)  # an earlier head replays more blocks
    # a screen's top 10 are not known before it runs: counted at the longest replays (layer 0's), besides
    # the key heads by name (L0H3 among the ten, L2H5 not): 11 heads of layer 0 and one of layer 2
    stacks = math.ceil(11 / stacked) * stacked * by_layer[0] + stacked * by_layer[2]
    expected = (
        counted["forward"] / rates["forward"]
        + stacks / rates["replay"]
        + screen_flops(build, probe, "atp") / rates["screen"]
    )
    assert rung2_seconds(build, probe, 10, ["L0H3", "L2H5"], "atp") == pytest.approx(expected, rel=1e-12)
    # named heads (a gate's key heads): each layer's replays, its count filled to a multiple of the
    # stack as `_replayed_deltas` fills it; the replays by layer add up to the full scan
    assert counted["forward"] + heads / build.geometry.n_layers * sum(by_layer) == pytest.approx(
        counted["scan"], rel=1e-12
    )
    in_layer_0 = min(stacked + 1, build.geometry.n_heads)  # a group and a head where the layer has them
    named = [f"L0H{h}" for h in range(in_layer_0)] + ["L1H0"]  # and one head of layer 1
    filled = math.ceil(in_layer_0 / stacked) * stacked * by_layer[0] + stacked * by_layer[1]
    assert exact_seconds(build, probe, named) == pytest.approx(
        counted["forward"] / rates["forward"] + filled / rates["replay"], rel=1e-12
    )
    # after the scan: the plan's estimate with the heads that ran in place of those it counted, which
    # were a gate's key heads by name, else the screen's top K at the longest replays
    from pytest_circuits.rungs.plan import replanned

    ran = ["L1H0", "L2H5"]
    swap = exact_seconds(build, probe, ran) - exact_seconds(build, probe, named)
    assert replanned(build, probe, 100.0, ran, key_heads=named) == pytest.approx(100.0 + swap, rel=1e-12)
    top = [f"L0H{h}" for h in range(3)]  # a screen's top 3 are counted as layer 0's
    assert replanned(build, probe, 100.0, ran, top_k=3) == pytest.approx(
        100.0 + exact_seconds(build, probe, ran) - exact_seconds(build, probe, top), rel=1e-12
    )
    assert replanned(build, probe, 100.0, ran) == 100.0  # every head exactly: nothing was chosen


def test_a_short_pass_is_timed_twice_and_the_faster_counts(tmp_path, monkeypatch):
    """A first pass of a shape sets up its kernels (oneDNN's bf16 ones per shape), so a pass under
    `RETIME_BELOW_S` is timed again and the faster time is the rate; a longer one is timed once."""
    from pytest_circuits.rungs import plan

    build = _session_of(_wide_model(tmp_path)).loaded.build("fp32")
    probe = RepeatSettings(seed=1, n=8, L=8)
    counted = plan.probe_flops(build, probe)
    for timings, calls in (([3.0, 1.0], 2), ([1.0, 3.0], 2), ([plan.RETIME_BELOW_S + 1, 1.0], 1)):
        plan._CALIBRATED.pop(build.model, None)
        said = iter(timings)
        monkeypatch.setattr(plan, "_wall", lambda device, run, said=said: next(said))
        assert plan.calibrated_rate(build, probe, "forward") == counted / min(timings[:calls])
        assert len(list(said)) == len(timings) - calls


@pytest.mark.slow
@requires_smollm2()
def test_a_heads_figures_do_not_depend_on_the_heads_stacked_with_it():
    """Every replay stacks the same number of knockouts (`knockout._replayed_deltas` fills a layer's
    last group), so a matmul's rounding, which depends on its rows in bf16, is the same for a head
    measured alone, in a pair or in the whole layer: a gate's key heads get the full scan's figures."""
    build = load_build(resolve_model("smollm2-135m"), "bf16", "cpu")  # the embedded model's rounding does not move
    settings = RepeatSettings(seed=1, n=8, L=64)

    def deltas(heads):
        frame = knockout_scan(build, settings, heads=heads, knockouts_per_pass=2, progress=False).set_index("head")
        return {h: frame.loc[h, knockout.SEQUENCES] for h in heads}

    alone, pair, three = deltas(["L27H2"]), deltas(["L27H1", "L27H2"]), deltas(["L27H0", "L27H1", "L27H2"])
    assert alone["L27H2"] == pair["L27H2"] == three["L27H2"] and pair["L27H1"] == three["L27H1"]

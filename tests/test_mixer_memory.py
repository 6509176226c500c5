"""The activations of a hybrid stack's reference Mamba-2 scan (model/mixer_memory.py, #52): what autograd
keeps is counted exactly; at Falcon-H1-1.5B's shape one sequence's backward does not fit the budget, so
the screen recomputes each block, with the same estimates; knockout forwards and stacked replays are
capped alike; models without the reference scan keep their rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pytest_circuits.model import mixer_memory
from pytest_circuits.model.mixer_memory import activation_budget, block_bytes, kept_bytes, reference_scan, scan_rows
from pytest_circuits.rungs.repeat import repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings

T = 129  # the default probe's tokens: 2 x 64 and a BOS
ROOT = Path(__file__).resolve().parent.parent


def release_shape(name: str) -> dict:
    """A release's config dimensions, as `scripts/measure_sizes.py` builds its random-weight checkpoints."""
    spec = importlib.util.spec_from_file_location("measure_sizes", ROOT / "scripts" / "measure_sizes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {key: value for key, value in module.SHAPES[name].items() if key != "model_type"}


FALCON_H1_1_5B = release_shape("falcon-h1-1.5b")


def falcon_h1(device: str, **overrides):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    with torch.device(device):
        torch.manual_seed(0)
        return FalconH1ForCausalLM(FalconH1Config(**{**FALCON_H1_1_5B, **overrides})).to(torch.bfloat16).eval()


def graph_saved_bytes(output: torch.Tensor, own: set[int]) -> int:
    """The same count by another road: walk the autograd graph from ``output`` and read every node's
    ``_saved_*`` tensors, each storage once, the model's own tensors not."""
    seen: dict[int, int] = {}
    stack, visited = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                values = getattr(node, name)
                for value in values if isinstance(values, (tuple, list)) else (values,):
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in own:
                        seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        stack += [next_node for next_node, _ in node.next_functions]
    return sum(seen.values())


@pytest.mark.parametrize("family", ["falcon_h1", "llama"])
def test_kept_bytes_is_what_the_autograd_graph_holds(family):
    from pytest_circuits.testing import make_tiny_model

    model = make_tiny_model(family).requires_grad_(False)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    embed = model.get_input_embeddings()
    x = embed(torch.zeros(1, 17, dtype=torch.long)).detach().requires_grad_()
    with torch.enable_grad():
        logits = model(inputs_embeds=x, use_cache=False).logits
    expected = graph_saved_bytes(logits, own)
    # within 0.1%: the walk also reads a few scalar tensors the saving hooks are not handed (136 B on falcon_h1)
    assert expected > 0 and kept_bytes(model, 17) == pytest.approx(expected, rel=1e-3)
    assert kept_bytes(model, 33) > kept_bytes(model, 17)  # per length


def test_one_falcon_h1_1_5b_sequence_does_not_fit_so_the_screen_recomputes_blocks(monkeypatch):
    """Two blocks at Falcon-H1-1.5B's block shape, real weights: what one block keeps for a backward at the
    probe's length, scaled to the release's 24 blocks, is over the budget of its 3.1 GB of weights, while a
    block recomputed in the backward fits (the scan formerly peaked at 6.88 GB against 5.39 GB)."""
    from pytest_circuits.rungs.screen import ScreenLayout, screen_layout

    two = falcon_h1("cpu", num_hidden_layers=2, vocab_size=256)
    per_block = block_bytes(two, T)
    dense = T * (6 * 2048 + 4 * 4608) * 2  # the formula a dense block's activations follow
    assert per_block > 10 * dense  # the reference scan's float32 intermediates
    full = falcon_h1("meta")  # the release's parameter sizes, no memory
    monkeypatch.setattr(mixer_memory, "kept_bytes", lambda model, tokens: 24 * per_block)
    import pytest_circuits.rungs.screen as screen

    monkeypatch.setattr(screen, "kept_bytes", mixer_memory.kept_bytes)
    budget = activation_budget(full)
    assert 24 * per_block > budget
    build = SimpleNamespace(
        model=full, device=torch.device("cpu"), tokens=SimpleNamespace(bos_id=1), geometry=SimpleNamespace(d_model=2048)
    )
    layout = screen_layout(build, 8, 64)
    assert layout == ScreenLayout(budget // (2 * per_block + 24 * T * 2048 * 2), recompute=True) and layout.rows >= 1
    assert scan_rows(full, 8, T, "cpu") == budget // (mixer_memory.NO_GRAD_FACTOR * per_block) >= 1


def test_a_stacked_knockout_replay_is_capped_like_one_forward(monkeypatch):
    """The replay stacks knockouts on the sequences of a pass (at most 2,048 tokens on a CPU): on the
    reference scan that is rows x stacked sequences at once, capped as one forward's rows."""
    from pytest_circuits.rungs.knockout import auto_per_pass

    full = falcon_h1("meta")
    monkeypatch.setattr(mixer_memory, "kept_bytes", lambda model, tokens: 24 * 110 * 10**6)
    rows = scan_rows(full, 64, T, "cpu")
    assert 1 <= rows < 8
    build = SimpleNamespace(model=full, device=torch.device("cpu"), llm_int8=False)
    assert auto_per_pass(build, None, 1, 8, T) == rows
    assert auto_per_pass(build, None, rows, 8, T) == 1


@pytest.mark.parametrize("model_type", ["falcon_h1", "nemotron_h"])
def test_the_screen_with_recomputed_blocks_gives_the_kept_screens_estimates(tiny_fp32_builds, model_type):
    from pytest_circuits.rungs.screen import atp

    build = tiny_fp32_builds(model_type)
    settings = RepeatSettings(seed=1, n=3, L=8)
    ids = repeat_tokens(build.tokens, settings.n, settings.L, settings.seed)
    block, inner = next(  # the last block with a Mamba-2 mixer, whose scan keeps most
        (block, module)
        for block in reversed(build.model.model.layers)
        for module in block.modules()
        if type(module).__name__.endswith("Mixer") and hasattr(module, "A_log")
    )
    outer_calls: list[int] = []
    inner_calls: list[int] = []
    handles = [block.register_forward_hook(lambda *_: outer_calls.append(0))]
    handles.append(inner.register_forward_pre_hook(lambda *_: inner_calls.append(0)))  # a recomputation stops early
    try:
        kept = atp(build, ids, settings.L, "zero", None, 2)
        recomputed = atp(build, ids, settings.L, "zero", None, 2, recompute=True)
    finally:
        for handle in handles:
            handle.remove()
    # two chunks a run; inside the block the recomputing run's backward runs it once more a chunk
    assert len(outer_calls) == 2 + 2 and len(inner_calls) == 2 + 4
    assert np.abs(kept).max() > 1e-4  # the heads move the copy loss
    np.testing.assert_allclose(recomputed, kept, rtol=1e-6, atol=1e-9)
    assert all("forward" not in vars(block) for block in build.model.model.layers)  # put back


def test_models_without_a_reference_scan_keep_their_rows():
    from pytest_circuits.rungs.knockout import CPU_TOKENS_PER_PASS, auto_per_pass
    from pytest_circuits.testing import make_tiny_model

    llama, falcon = make_tiny_model("llama"), make_tiny_model("falcon_h1")
    assert not reference_scan(llama, "cpu") and scan_rows(llama, 8, T, "cpu") == 8
    assert reference_scan(falcon, "cpu") and scan_rows(falcon, 8, T, "cpu") == 8  # small: under budget
    for model in (llama, falcon):
        build = SimpleNamespace(model=model, device=torch.device("cpu"), llm_int8=False)
        assert auto_per_pass(build, None, 8, 4, 33) == CPU_TOKENS_PER_PASS // (4 * 33)


def test_a_large_build_on_the_reference_scan_maps_its_large_blocks(monkeypatch):
    """`lean_heap`: only a build of more than 1 GB on the reference scan asks glibc to map large blocks."""
    from pytest_circuits.model.mixer_memory import lean_heap
    from pytest_circuits.testing import make_tiny_model

    calls: list[int] = []
    monkeypatch.setattr(mixer_memory, "map_large_blocks", lambda: calls.append(1) or True)
    assert lean_heap(falcon_h1("meta"), "cpu") and calls == [1]
    assert not lean_heap(make_tiny_model("falcon_h1"), "cpu")  # small
    assert not lean_heap(make_tiny_model("llama"), "cpu") and calls == [1]  # no reference scan


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="mallopt's M_MMAP_THRESHOLD is glibc's")
def test_glibc_takes_the_mapping_threshold():
    import subprocess
    import sys

    code = "from pytest_circuits.model.mixer_memory import map_large_blocks as m; print(m(), m.cache_info().hits)"
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert said.split() == ["True", "0"]

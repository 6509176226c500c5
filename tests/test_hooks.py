"""`model.hooks.hooked`, the one hook primitive: every hook gone on exit, and no module hooks a model without it."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import pytest_circuits
from pytest_circuits.model.families import attention_module, layer_modules
from pytest_circuits.model.hooks import KINDS, hooked
from pytest_circuits.testing import make_tiny_model

PACKAGE = Path(pytest_circuits.__file__).resolve().parent
PRIMITIVE = PACKAGE / "model" / "hooks.py"
REGISTERS = {"register_forward_hook", "register_forward_pre_hook"}


def hook_counts(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def every_kind(model, seen: list):
    """One hook of each kind, each changing nothing it returns, on the first block and its attention."""
    block, attn = layer_modules(model)[0], attention_module(model, 0)
    return [
        (block, "pre", lambda m, args: seen.append("pre")),
        (block, "pre_kwargs", lambda m, args, kwargs: seen.append("pre_kwargs")),
        (attn, "forward", lambda m, args, out: seen.append("forward")),
        (attn, "forward_kwargs", lambda m, args, kwargs, out: seen.append("forward_kwargs")),
    ]


def test_hooks_run_inside_and_are_gone_after_exit_and_after_an_exception():
    model = make_tiny_model("llama")
    untouched = copy.deepcopy(model)
    ids = torch.arange(3, 19)[None]
    seen: list = []
    before = hook_counts(model)
    with hooked(*every_kind(model, seen)):
        assert hook_counts(model) == before + len(KINDS)
        logits(model, ids)
    assert sorted(seen) == sorted(KINDS)
    assert hook_counts(model) == before

    def zero(module, args, output):
        return torch.zeros_like(output[0]), *output[1:]

    with pytest.raises(RuntimeError, match="boom"), hooked((attention_module(model, 0), "forward", zero)):
        assert not torch.equal(logits(model, ids), logits(untouched, ids))  # the hook did act
        raise RuntimeError("boom")
    assert hook_counts(model) == before
    torch.testing.assert_close(logits(model, ids), logits(untouched, ids), rtol=0, atol=0)


def test_a_bad_kind_is_refused_and_removes_the_hooks_already_added():
    model = make_tiny_model("llama")
    before = hook_counts(model)
    good = every_kind(model, [])
    with pytest.raises(ValueError, match="hook kind 'post'"), hooked(*good, (model, "post", print)):
        pass
    assert hook_counts(model) == before


def direct_registrations(path: Path) -> list[str]:
    """``file:line`` of every call of torch's hook registration methods in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REGISTERS
    ]


def test_no_module_but_the_primitive_registers_hooks():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != PRIMITIVE for hit in direct_registrations(path)]
    assert not found, "hook through pytest_circuits.model.hooks.hooked, not directly: " + ", ".join(found)
    assert direct_registrations(PRIMITIVE)  # the check sees a call where there is one

"""What the gate catches: graded damage to a model's key heads, gated against its baseline.

A damage is a weight edit of the in-memory float build (``fp32``), applied, gated through the
gate's own code (`records.measure_record` measured the baseline's way, `gate.invariants.gate_all`),
then undone exactly (`Restorer`, checked bit for bit). Damages of head ``L{l}H{h}`` (``d`` its
slice of ``z``, the input of layer ``l``'s output projection; rows of ``W_Q`` per head as in
`model.families.qkv_rows`):

- ``ov_scale`` s: ``W_O[h] <- s W_O[h]``, so the head's output ``z_h W_O[h]`` becomes s times
  itself (``s = -1``: negated; ``W_OV -> s W_OV``).
- ``qk_scale`` t: ``W_Q[h] <- t W_Q[h]`` (and its bias), so the head's attention logits
  ``q k^T / sqrt(d_head)`` become t times themselves, exactly with rotary positions too
  (``t = 0``: uniform attention over the causal prefix). Only W_Q: under grouped-query
  attention ``W_K`` is shared by the group's heads. Refused for families with a norm on Q.
- ``ov_rotate`` angle a (degrees): ``W_O[h] <- cos a W_O[h] + sin a c W_O[h']`` with ``h'`` the
  next head of the layer and ``c = |W_O[h]|_F / |W_O[h']|_F``: the head's output turned into
  ``h'``'s output subspace (a = 90: it writes where ``h'`` writes).
- ``noise_layer`` / ``noise_all`` sigma: ``W <- W + sigma rms(W) N(0, 1)`` for every matrix of
  one decoder block (the damaged head's layer) / of every block.
- ``low_rank`` eps: ``W <- W + eps |W|_F U V^T / |U V^T|_F`` (U, V Gaussian, rank `LOW_RANK`) for
  every matrix of every block: a fine-tune-like update of relative size eps.

Severity (what "the smallest damage caught" orders by): ``1 - s``, ``1 - t``, a, sigma, eps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from ..errors import CircuitsError
from ..model.dense import float_weight, head_columns, is_conv1d
from ..model.families import (
    attention_module,
    family_of,
    geometry_of,
    get_module,
    head_label,
    layer_modules,
    out_proj_module,
    qkv_rows,
)
from ..record.schema import Record

LOW_RANK = 8  # rank of the fine-tune-like update
OV_SCALES = (0.9, 0.75, 0.5, 0.25, 0.0, -1.0)
QK_SCALES = (0.75, 0.5, 0.25, 0.0)
ROTATIONS = (30.0, 60.0, 90.0)
NOISE = (0.01, 0.03, 0.1, 0.3)
LOW_RANK_SIZES = (0.03, 0.1, 0.3, 1.0)
KINDS = ("ov_scale", "qk_scale", "ov_rotate", "noise_layer", "noise_all", "low_rank")


def parse_head(label: str) -> tuple[int, int]:
    """``"L1H0"`` -> ``(1, 0)``."""
    layer, _, head = label[1:].partition("H")
    return int(layer), int(head)


# ---------------------------------------------------------------- weight edits (in place, float builds)


@torch.no_grad()
def scale_head_ov(model, layer: int, head: int, s: float) -> None:
    """``W_O[h] <- s W_O[h]`` in place: head ``L{layer}H{head}``'s output times ``s``."""
    d_head = geometry_of(model).d_head
    proj = out_proj_module(model, layer)
    head_columns(proj, float_weight(proj), slice(head * d_head, (head + 1) * d_head)).mul_(s)


@torch.no_grad()
def rotate_head_ov(model, layer: int, head: int, degrees: float) -> str:
    """``W_O[h] <- cos a W_O[h] + sin a c W_O[h']`` in place (``h'`` the next head of the layer,
    ``c`` matching the Frobenius norms); returns ``h'``'s label."""
    geo = geometry_of(model)
    other = (head + 1) % geo.n_heads
    proj = out_proj_module(model, layer)
    weight = float_weight(proj)
    mine = head_columns(proj, weight, slice(head * geo.d_head, (head + 1) * geo.d_head))
    theirs = head_columns(proj, weight, slice(other * geo.d_head, (other + 1) * geo.d_head)).clone()
    c = mine.norm() / theirs.norm().clamp_min(1e-30)
    a = math.radians(degrees)
    mine.mul_(math.cos(a)).add_(theirs * (c * math.sin(a)))
    return head_label(layer, other)


@torch.no_grad()
def scale_head_qk(model, layer: int, head: int, t: float) -> None:
    """``W_Q[h] <- t W_Q[h]`` (and its bias) in place: the head's attention logits times ``t``."""
    fam, geo = family_of(model), geometry_of(model)
    if {"qk_norm", "qk_norm_full"} & set(fam.quirks):
        raise CircuitsError(
            f"qk_scale: {fam.name} normalises Q after W_Q, which undoes a scale of W_Q; "
            "the QK damage is not defined for this family"
        )
    attn = attention_module(model, layer)
    q_rows, _, _ = qkv_rows(fam.qkv_layout, geo)
    module = get_module(attn, fam.qkv[0])  # W_Q: the fused projection, or q_proj
    index = torch.tensor(q_rows[head])
    weight = float_weight(module)
    if is_conv1d(module):  # stored (in, out)
        weight[:, index] *= t
    else:
        weight[index, :] *= t
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias[index] *= t


def _block_matrices(model, layers) -> list[torch.nn.Parameter]:
    """Every 2-D float parameter of the decoder blocks ``layers``, in name order."""
    blocks = layer_modules(model)
    out = []
    for layer in layers:
        named = sorted(blocks[layer].named_parameters(), key=lambda kv: kv[0])
        out += [p for _, p in named if p.dim() == 2 and p.dtype.is_floating_point]
    return out


@torch.no_grad()
def add_block_noise(model, layers, sigma: float, seed: int = 0) -> None:
    """``W <- W + sigma rms(W) N(0, 1)`` for every matrix of the blocks ``layers``, in place."""
    generator = torch.Generator().manual_seed(seed)
    for param in _block_matrices(model, layers):
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        rms = param.detach().float().pow(2).mean().sqrt()
        param.add_((sigma * rms * noise).to(param.dtype))


@torch.no_grad()
def add_low_rank(model, eps: float, rank: int = LOW_RANK, seed: int = 0) -> None:
    """``W <- W + eps |W|_F U V^T / |U V^T|_F`` (Gaussian U, V of rank ``rank``) for every matrix of every block."""
    generator = torch.Generator().manual_seed(seed)
    for param in _block_matrices(model, range(len(layer_modules(model)))):
        u = torch.randn(param.shape[0], rank, generator=generator)
        v = torch.randn(param.shape[1], rank, generator=generator)
        update = u @ v.T
        param.add_((eps * param.detach().float().norm() * update / update.norm()).to(param.dtype))


# ---------------------------------------------------------------- damages


@dataclass(frozen=True)
class Damage:
    """One graded damage: ``kind`` (`KINDS`), its ``strength`` and the head it is aimed at."""

    kind: str
    strength: float
    head: str = ""  # "L1H0"; noise_all and low_rank: the whole model
    seed: int = 0

    @property
    def severity(self) -> float:
        """How strong it is, in one direction for every kind: 0 is no damage."""
        if self.kind in ("ov_scale", "qk_scale"):
            return 1.0 - self.strength
        return self.strength

    def describe(self) -> str:
        s = self.strength
        return {
            "ov_scale": f"{self.head} OV negated" if s == -1 else f"{self.head} OV x{s:g}",
            "qk_scale": f"{self.head} QK x{s:g}",
            "ov_rotate": f"{self.head} OV rotated {s:g} deg",
            "noise_layer": f"noise {s:g} in {self.head}'s layer",
            "noise_all": f"noise {s:g} in every layer",
            "low_rank": f"rank-{LOW_RANK} update {s:g}",
        }[self.kind]

    def apply(self, model) -> None:
        """Edit ``model``'s weights in place (undo with `Restorer`)."""
        layer, head = parse_head(self.head) if self.head else (0, 0)
        if self.kind == "ov_scale":
            scale_head_ov(model, layer, head, self.strength)
        elif self.kind == "qk_scale":
            scale_head_qk(model, layer, head, self.strength)
        elif self.kind == "ov_rotate":
            rotate_head_ov(model, layer, head, self.strength)
        elif self.kind == "noise_layer":
            add_block_noise(model, [layer], self.strength, self.seed)
        elif self.kind == "noise_all":
            add_block_noise(model, range(len(layer_modules(model))), self.strength, self.seed)
        elif self.kind == "low_rank":
            add_low_rank(model, self.strength, seed=self.seed)
        else:
            raise CircuitsError(f"unknown damage {self.kind!r}; known: {', '.join(KINDS)}")


def head_damages(heads, ov=OV_SCALES, qk=QK_SCALES, rotations=ROTATIONS, noise=NOISE) -> list[Damage]:
    """Per head: OV scales, QK scales, rotations and one-layer noise (once per layer), each mildest first."""
    out, layers = [], set()
    for head in heads:
        out += [Damage("ov_scale", s, head) for s in ov]
        out += [Damage("qk_scale", t, head) for t in qk]
        out += [Damage("ov_rotate", a, head) for a in rotations]
        if parse_head(head)[0] not in layers:
            out += [Damage("noise_layer", sigma, head) for sigma in noise]
        layers.add(parse_head(head)[0])
    return out


def model_damages(noise=NOISE, low_rank=LOW_RANK_SIZES) -> list[Damage]:
    """Whole-model damages: noise in every block, low-rank updates of growing size."""
    return [Damage("noise_all", s) for s in noise] + [Damage("low_rank", e) for e in low_rank]


class Restorer:
    """Every float parameter of a model, saved once; `restore` puts them back and checks bit equality."""

    def __init__(self, model):
        self.model = model
        self.saved = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype.is_floating_point}

    @torch.no_grad()
    def restore(self) -> None:
        params = dict(self.model.named_parameters())
        for name, value in self.saved.items():
            params[name].copy_(value)
        bad = [n for n, v in self.saved.items() if not torch.equal(params[n], v)]
        if bad:
            raise RuntimeError(f"restoring the weights failed for {len(bad)} parameters, e.g. {bad[0]}")


def check_damageable(model, damages, build_name: str) -> None:
    """Each kind of damage applied once and undone, before any gate runs: a build whose weights
    cannot take it (a quantized build) is one line now, not a traceback after the intact gate."""
    restorer = Restorer(model)
    for damage in {(d.kind, d.head): d for d in damages}.values():
        try:
            damage.apply(model)
        except TypeError as error:  # model.dense.float_weight: a quantized module
            raise CircuitsError(
                f"--build {build_name}: sensitivity damages float weights, and this build's cannot be edited "
                f"({error}); run it on a float build: fp32, bf16, fp16 or rtn-*"
            ) from None
        finally:
            restorer.restore()


# ---------------------------------------------------------------- gating a damaged build


@dataclass
class Outcome:
    """The gate's verdicts on one damaged build: the invariants that failed, and the model figures.

    ``failed``: the invariants that compared figures and found one moved (a catch); ``empty``: those
    that failed because they compared nothing (the gate fails, but no damage was measured, so a
    sweep never counts them as catching it)."""

    damage: Damage | None
    label: str
    failed: list[str]
    passed: list[str]
    copy_loss: float
    first_copy_loss: float
    seconds: float
    text_loss: float | None = None
    results: list = field(default_factory=list, repr=False)
    record: dict = field(default_factory=dict, repr=False)
    empty: list[str] = field(default_factory=list)

    def verdict(self) -> str:
        """``pass``, or ``FAIL`` with the invariants that caught a move and those that compared nothing."""
        words = ["FAIL " + ", ".join(self.failed)] if self.failed else []
        words += [f"compared nothing: {', '.join(self.empty)}"] if self.empty else []
        return "; ".join(words) or "pass"


def gate_record(run, build_name: str, baseline: dict, tol, knockout: bool = True) -> tuple[list, Record]:
    """``(results, record)``: ``build_name`` as the run holds it now, measured the baseline's way
    (`run.flow.candidate_record`'s rule) and settled against it by the run's one flow (`run.flow.settle`:
    the compatibility checks, the further looks, `gate.check.check`). Knockouts run on the baseline's
    key heads only: the only ones `knockout_deltas` compares, so the verdict is the full scan's.
    ``knockout=False``: no knockouts, so `knockout_deltas` is not run (not passed)."""
    from ..gate.invariants import key_heads
    from ..record import kappa_method
    from ..record.read import has_figures
    from .flow import settle
    from .records import measure_record

    run.loaded.forget_figures(build_name)
    knockout = knockout and has_figures(baseline, "knockout")
    keys = tuple(key_heads(baseline, "knockout_delta", tol.top_k, tol.min_delta)) if knockout else ()
    record = measure_record(
        run.measured, build_name, knockout=knockout, method=kappa_method.of_record(baseline), key_heads=keys
    )
    record, verdicts = settle(run.records, build_name, baseline, record, tol, label="baseline", across=False)
    return verdicts.results, record


def gate_outcome(
    run, build_name, baseline, tol, damage=None, label="", text_loss=None, knockout: bool = True
) -> Outcome:
    """`gate_record` of the build as it stands, summarised; ``text_loss(run, build_name)``: held-out loss."""
    start = time.perf_counter()
    results, record = gate_record(run, build_name, baseline, tol, knockout)
    return Outcome(
        damage,
        label or (damage.describe() if damage else build_name),
        [r.invariant for r in results if r.status == "failed" and r.compared],
        [r.invariant for r in results if r.status == "passed"],
        float(record.copy_loss),
        float(record.first_copy_loss),
        time.perf_counter() - start,
        None if text_loss is None else text_loss(run, build_name),
        results,
        record.data,
        [r.invariant for r in results if r.status == "failed" and not r.compared],
    )


def sweep(
    run, baseline: dict, damages, tol, build_name: str = "fp32", text_loss=None, write=None, knockout: bool = True
) -> list[Outcome]:
    """Gate the intact build, then each damage of it, undoing each exactly before the next."""
    model = run.loaded.build(build_name).model
    restorer = Restorer(model)
    outcomes = [gate_outcome(run, build_name, baseline, tol, label="intact", text_loss=text_loss, knockout=knockout)]
    for damage in damages:
        try:
            damage.apply(model)
            outcomes.append(
                gate_outcome(run, build_name, baseline, tol, damage, text_loss=text_loss, knockout=knockout)
            )
        finally:
            restorer.restore()
        if write is not None:
            o = outcomes[-1]
            write(f"{o.label}: {o.verdict()} ({o.seconds:.1f} s)")
    run.loaded.forget_figures(build_name)
    return outcomes


def _target(damage: Damage) -> str:
    """The row a damage belongs to: its kind, and its head for a head damage."""
    return f"{damage.head} {KIND_TITLES[damage.kind]}" if damage.kind in HEAD_KINDS else KIND_TITLES[damage.kind]


def smallest_caught(outcomes: list[Outcome], invariants) -> dict[str, dict[str, Damage | None]]:
    """``{row: {invariant: the mildest damage of that row it failed on (None: none)}}``, and ``"any"``
    for the mildest that failed the gate; rows as `_target` names them, in the order run."""
    table: dict[str, dict[str, Damage | None]] = {}
    for o in outcomes:
        if o.damage is None:
            continue
        row = table.setdefault(_target(o.damage), {i: None for i in (*invariants, "any")})
        for inv in (*invariants, "any"):
            best = row[inv]
            fired = bool(o.failed) if inv == "any" else inv in o.failed
            if fired and (best is None or o.damage.severity < best.severity):
                row[inv] = o.damage
    return table


def caught_cell(damage: Damage | None, kind: str) -> str:
    """How a table cell names the mildest damage caught (``no``: none of those run)."""
    if damage is None:
        return "no"
    s = damage.strength
    if kind == "ov_scale":
        return "negated" if s == -1 else f"s <= {s:g}"
    if kind == "qk_scale":
        return f"t <= {s:g}"
    if kind == "ov_rotate":
        return f">= {s:g} deg"
    return f">= {s:g}"


HEAD_KINDS = ("ov_scale", "qk_scale", "ov_rotate", "noise_layer")
KIND_TITLES = {
    "ov_scale": "OV x s",
    "qk_scale": "QK logits x t",
    "ov_rotate": "OV rotated into the next head",
    "noise_layer": "noise sigma in its layer",
    "noise_all": "noise sigma in every layer",
    "low_rank": f"rank-{LOW_RANK} update of size eps, every layer",
}


def caught_table(outcomes: list[Outcome], invariants) -> list[str]:
    """Markdown rows: per damage (and head), the mildest damage each invariant catches, and the gate."""
    table = smallest_caught(outcomes, invariants)
    kinds = {_target(o.damage): o.damage.kind for o in outcomes if o.damage is not None}
    lines = [
        "| damage | " + " | ".join(f"`{i}`" for i in invariants) + " | gate |",
        "|---" * (len(invariants) + 2) + "|",
    ]
    for row, cells in table.items():
        kind = kinds[row]
        lines.append(f"| {row} | " + " | ".join(caught_cell(cells[i], kind) for i in (*invariants, "any")) + " |")
    return lines


# ---------------------------------------------------------------- the `circuits sensitivity` command


def damaged_heads(baseline: dict, tol, count: int) -> list[str]:
    """The baseline's top ``count`` key heads: by knockout delta, then the top induction head."""
    from ..gate.invariants import key_heads

    heads = key_heads(baseline, "knockout_delta", 0, tol.min_delta)[:count]
    induction = key_heads(baseline, "prefix_matching", 1, tol.min_score)
    return list(dict.fromkeys(heads + induction)) if heads or induction else []


def run_command(run, baseline: dict, tol, count: int, build_name: str, write=print) -> bool:
    """The reduced sweep of ``circuits sensitivity``: OV and QK scales of the top key heads;
    prints each verdict and the mildest damage each invariant catches. False when the intact
    build does not pass against the baseline (nothing it then catches means anything)."""
    from ..gate.invariants import per_build_invariants
    from ..record.store import geometry_difference, geometry_record

    other = geometry_difference(baseline, geometry_record(run.loaded.preflight().__dict__))
    if other:  # before any work: its key heads name heads of another model
        raise CircuitsError(
            f"the baseline is of another model (geometry {other}): its key heads are not this model's; "
            "pass this model's baseline (--baseline FILE) or none (the build's own)"
        )
    heads = damaged_heads(baseline, tol, count)
    if not heads:
        raise CircuitsError("the baseline has no key head (knockout delta or prefix matching): nothing to damage")
    damages = head_damages(heads, rotations=(), noise=())
    check_damageable(run.loaded.build(build_name).model, damages, build_name)
    write(f"damaging {', '.join(heads)} of {build_name}: {len(damages)} damages, each gated against the baseline")
    outcomes = sweep(run, baseline, damages, tol, build_name, write=write)
    intact = outcomes[0]
    if intact.failed or intact.empty or not intact.passed:
        write(f"the intact {build_name} build fails against the baseline ({intact.verdict()}): fix that first")
        return False
    invariants = [i for i in per_build_invariants() if any(i in o.passed + o.failed for o in outcomes)]
    write("mildest damage caught with these tolerances (no: none of the damages run):")
    for line in caught_table(outcomes, invariants):
        write(line)
    return True


def with_seeds(run, probe_seed: int, knockout_seed: int) -> None:
    """Point the run at other probe and knockout sequences (figures measured again)."""
    s = run.settings
    run.loaded.settings = replace(s, probe=replace(s.probe, seed=probe_seed), knockout_seed=knockout_seed)
    run.loaded.forget_figures()

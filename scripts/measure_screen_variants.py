"""Recall and cost of the cheaper knockout screens (issue 41 item 2) against the exact scan.

Per model and screen variant (`rungs.screen.ScreenVariant`): the recall of the exact scan's top 5
heads (largest ``knockout_delta``) within the screen's top 12 (and top 5), its CPU seconds and
its cost in forward-equivalents, timed (CPU seconds over those of one grad-free forward of the
same sequences). Exact scans: SmolLM2-135M's and the embedded model's shipped fp32 baselines
(every head exactly, zero ablation, held-out seed 1, n 8, L 64); a Gemma-3-270M shape (its exact
config, seeded random weights built here, never shipped) is scanned exactly here at ``--gemma-n``,
``--gemma-length``. Each model's rows go to ``--results`` (JSON lines, so models run as separate
processes); ``--write-docs`` writes the table from all rows into docs/speed.md's
``screen-variants`` block.

    OMP_NUM_THREADS=1 python scripts/measure_screen_variants.py --models embedded,gemma-3-270m,smollm2-135m \\
        --results /tmp/screen-variants.jsonl --write-docs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "speed.md"
BLOCK_NAME = "screen-variants"
GEMMA_3_270M = dict(  # google/gemma-3-270m's config.json (text part)
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=262144,
    max_position_embeddings=32768,
    query_pre_attn_scalar=256,
    sliding_window=512,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    layer_types=["sliding_attention"] * 5
    + ["full_attention"]
    + ["sliding_attention"] * 5
    + ["full_attention"]
    + ["sliding_attention"] * 5
    + ["full_attention"],
)
# (name, method, ScreenVariant keywords): today's screens first
VARIANTS: list[tuple[str, str, dict]] = [
    ("atp* (today, <= 1e14 FLOP on a CPU)", "atp*", {}),
    ("atp (today at 8B on a CPU)", "atp", {}),
    ("atp*, QK fix on AtP's top 24", "atp*", {"qk_top": 24}),
    ("atp*, QK fix on AtP's top 48", "atp*", {"qk_top": 48}),
    ("atp*, half the sequences", "atp*", {"sequences": 1 / 2}),
    ("atp*, a quarter of the sequences", "atp*", {"sequences": 1 / 4}),
    ("atp, a quarter of the sequences", "atp", {"sequences": 1 / 4}),
    ("atp, mean of zero and mean ablation", "atp", {"ablation": "both"}),
    ("atp*, QK fix on top 24, half the sequences", "atp*", {"qk_top": 24, "sequences": 1 / 2}),
    ("atp*gd, GradDrop on 4 blocks", "atp*gd", {"grad_drop_layers": 4}),
    ("atp*, mean of zero and mean ablation", "atp*", {"ablation": "both"}),
]


def cpu_seconds() -> float:
    return time.process_time()


def gemma_folder(folder: Path) -> Path:
    """A Gemma-3-270M-shaped fp32 checkpoint with seeded random weights (written once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = AutoConfig.for_model("gemma3_text", **GEMMA_3_270M)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def load(model: str, folder: Path):
    """``(build, settings, exact deltas (n_layers, n_heads), mode)`` of one model."""
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.record.store import read_baseline
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    if model == "gemma-3-270m":
        build = load_build(resolve_model(str(gemma_folder(folder / "gemma-3-270m"))), "fp32", "cpu")
        settings = RepeatSettings(seed=1, n=OPTIONS.gemma_n, L=OPTIONS.gemma_length)
        cache = folder / f"gemma-exact-n{settings.n}-L{settings.L}.json"
        if cache.exists():
            deltas = np.array(json.loads(cache.read_text()))
        else:
            start = cpu_seconds()
            frame = knockout_scan(build, settings, progress=False)
            geo = build.geometry
            deltas = frame["knockout_delta"].to_numpy().reshape(geo.n_layers, geo.n_heads)
            cache.write_text(json.dumps(deltas.tolist()))
            print(f"gemma exact scan: {cpu_seconds() - start:.0f} CPU-s", file=sys.stderr)
        return build, settings, deltas, "zero"
    name = {"embedded": "tiny-induction", "smollm2-135m": "smollm2-135m"}[model]
    record = read_baseline(ROOT / "pytest_circuits" / "baselines" / f"{name}--fp32.json")
    knock = record["knockout"]
    assert knock.get("screened") in (None, False), f"{name}'s baseline scan is screened"
    build = load_build(resolve_model(name), "fp32", "cpu")
    geo = build.geometry
    deltas = np.full((geo.n_layers, geo.n_heads), np.nan)
    for head in record["heads"]:
        deltas[head["layer"], head["head_index"]] = head["knockout_delta"]
    assert np.isfinite(deltas).all(), f"{name}'s baseline lacks exact deltas"
    return build, RepeatSettings(seed=knock["seed"], n=knock["n"], L=knock["L"]), deltas, knock["mode"]


def top(values: np.ndarray, k: int) -> set[tuple[int, int]]:
    order = sorted(np.ndindex(values.shape), key=lambda p: (-values[p], p))
    return set(order[:k])


def variant_of(knobs: dict, n: int):
    """The `ScreenVariant` of ``knobs``, a fractional ``sequences`` taken of ``n``."""
    from pytest_circuits.rungs.screen import ScreenVariant

    fraction = knobs.get("sequences")
    if isinstance(fraction, float):
        knobs = {**knobs, "sequences": max(1, round(fraction * n))}
    return ScreenVariant(**knobs)


def derived_scores(atp_z, atp_m, star, chunk: int) -> dict[str, np.ndarray]:
    """Every variant but GradDrop's ranking score from per-chunk screens (``chunk`` sequences each):
    the estimates add over sequences (each chunk's loss is its own mean: a common factor), the QK
    fix on top C is AtP* on AtP's top C and AtP elsewhere (`screen._one_screen`)."""

    def first(parts, k):
        return sum(parts[: max(1, k // chunk)])

    def qk_top(n_seq, c):
        a, b = first(atp_z, n_seq), first(star, n_seq)
        out = a.copy()
        for p in list(sorted(np.ndindex(a.shape), key=lambda p: (-abs(a[p]), p)))[:c]:
            out[p] = b[p]
        return np.abs(out)

    n = chunk * len(atp_z)
    return {
        VARIANTS[0][0]: np.abs(first(star, n)),
        VARIANTS[1][0]: np.abs(first(atp_z, n)),
        VARIANTS[2][0]: qk_top(n, 24),
        VARIANTS[3][0]: qk_top(n, 48),
        VARIANTS[4][0]: np.abs(first(star, n // 2)),
        VARIANTS[5][0]: np.abs(first(star, n // 4)),
        VARIANTS[6][0]: np.abs(first(atp_z, n // 4)),
        VARIANTS[7][0]: (np.abs(first(atp_z, n)) + np.abs(first(atp_m, n))) / 2,
        VARIANTS[8][0]: qk_top(n // 2, 24),
    }


def measure(model: str, folder: Path, only: list[str] | None, results: Path | None) -> list[dict]:
    """One AtP* screen and two plain AtP screens (zero, mean) per chunk of 2 sequences; every
    variant's ranking derived from them (`derived_scores`), GradDrop's and atp*'s mean of both
    ablations run as themselves on models of at most 100 heads. Cost: counted forward-equivalents
    (`plan.screen_flops` of the variant over one forward), and the CPU seconds of what ran."""
    from pytest_circuits.rungs.plan import knockout_flops, screen_flops
    from pytest_circuits.rungs.replay import attention_implementation, held_out_ids, intact_pass
    from pytest_circuits.rungs.screen import atp, atp_star, screen_estimate

    build, settings, deltas, mode = load(model, folder)
    assert mode == "zero", "the derived variants assume zero ablation"
    ids = held_out_ids(build, settings)
    chunk, geo = max(1, settings.n // 4), build.geometry
    forward = knockout_flops(build, settings, heads=[])["forward"]
    atp_z, atp_m, star, spent = [], [], [], {"atp": 0.0, "atp*": 0.0}
    with attention_implementation(build.model):
        means = intact_pass(build, ids, settings.L, 8, trace=False).means
        for part in ids.split(chunk):
            start = cpu_seconds()
            atp_z.append(atp(build, part, settings.L, "zero", means, chunk))
            spent["atp"] += cpu_seconds() - start
            atp_m.append(atp(build, part, settings.L, "mean", means, chunk))
            start = cpu_seconds()
            star.append(atp_star(build, part, settings.L, "zero", means, chunk)[0])
            spent["atp*"] += cpu_seconds() - start
            print(f"{model}: chunk done, {spent}", file=sys.stderr, flush=True)
    scores = derived_scores(atp_z, atp_m, star, chunk)
    cpu = {VARIANTS[0][0]: spent["atp*"], VARIANTS[1][0]: spent["atp"]}
    if geo.n_layers * geo.n_heads <= 100:
        for name, method, knobs in VARIANTS[9:]:
            start = cpu_seconds()
            with attention_implementation(build.model):
                scores[name] = screen_estimate(
                    build, ids, settings.L, mode, means, method, chunk, variant=variant_of(knobs, settings.n)
                )[1]
            cpu[name] = cpu_seconds() - start
    exact5 = top(deltas, 5)
    rows = []
    for name, method, knobs in VARIANTS:
        if name not in scores or (only and name not in only):
            continue
        score = scores[name]
        row = dict(
            model=model,
            variant=name,
            settings=f"n {settings.n}, L {settings.L}, {mode}",
            recall12=len(exact5 & top(score, 12)) / 5,
            recall5=len(exact5 & top(score, 5)) / 5,
            cpu=cpu.get(name),
            forwards=screen_flops(build, settings, method, variant_of(knobs, settings.n)) / forward,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
        if results is not None:
            with results.open("a") as out:
                out.write(json.dumps(row) + "\n")
    return rows


def counted(shape: str, method: str, knobs: dict, n: int = 8, L: int = 64) -> float:
    """Counted FLOPs (`rungs.plan.screen_flops`) of a screen at a shape of scripts/measure_sizes.py,
    with the model built on the meta device (no weights), BOS prepended as Llama's tokenizer does."""
    from types import SimpleNamespace

    from measure_sizes import shape_config
    from transformers import AutoModelForCausalLM

    from pytest_circuits.model.family_resolution import geometry_of
    from pytest_circuits.rungs.plan import screen_flops
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape))
    build = SimpleNamespace(model=model, geometry=geometry_of(model), tokens=SimpleNamespace(bos_id=1))
    return screen_flops(build, RepeatSettings(seed=1, n=n, L=L), method, variant_of(knobs, n))


def at_shape(shape: str, folder: Path, names: list[str]) -> None:
    """CPU seconds of each named variant's screen at ``shape`` (bf16 random weights, built once under
    ``folder``; n 8, L 64, zero ablation), beside its counted TFLOP and the rate they imply."""
    from measure_sizes import build_checkpoint

    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.rungs.plan import screen_flops
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.rungs.replay import attention_implementation, held_out_ids, intact_pass
    from pytest_circuits.rungs.screen import screen_estimate

    where = folder / shape
    if not (where / "model.safetensors.index.json").exists():
        build_checkpoint(shape, where)
    build = load_build(resolve_model(str(where)), "bf16", "cpu")
    settings = RepeatSettings(seed=1, n=8, L=64)
    ids = held_out_ids(build, settings)
    with attention_implementation(build.model):
        means = intact_pass(build, ids, settings.L, 8, trace=False).means
    for name, method, knobs in VARIANTS:
        if name not in names:
            continue
        variant = variant_of(knobs, settings.n)
        start, wall = cpu_seconds(), time.perf_counter()
        with attention_implementation(build.model):
            screen_estimate(build, ids, settings.L, "zero", means, method, 8, variant=variant)
        cpu, wall = cpu_seconds() - start, time.perf_counter() - wall
        flops = screen_flops(build, settings, method, variant)
        row = dict(shape=shape, variant=name, cpu=cpu, wall=wall, tflop=flops / 1e12, rate=flops / cpu / 1e9)
        print(json.dumps(row), flush=True)


def count_table(shapes: list[str]) -> str:
    """Every variant's counted TFLOP at each shape (n 8, L 64; the QK fix on top C at its bound)."""
    lines = ["| screen | " + " | ".join(f"{s} TFLOP" for s in shapes) + " |", "|---|" + "---|" * len(shapes)]
    for name, method, knobs in VARIANTS:
        lines.append(f"| {name} | " + " | ".join(f"{counted(s, method, knobs) / 1e12:.1f}" for s in shapes) + " |")
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> str:
    latest = {(r["model"], r["variant"]): r for r in rows}
    models = list(dict.fromkeys(r["model"] for r in rows))
    lines = [
        "| screen | " + " | ".join(f"{m}: top 5 in 12 / in 5, forwards counted" for m in models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for name, _, _ in VARIANTS:
        cells = []
        for m in models:
            r = latest.get((m, name))
            cpu = "" if r is None or r["cpu"] is None else f", {r['cpu']:.1f} CPU-s"
            cells.append("" if r is None else f"{r['recall12']:.1f} / {r['recall5']:.1f}, {r['forwards']:.0f}{cpu}")
        if any(cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    settings = {m: next(r["settings"] for r in rows if r["model"] == m) for m in models}
    lines.append("")
    lines.append("Settings (held-out seed 1): " + "; ".join(f"{m} {s}" for m, s in settings.items()) + ".")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    global OPTIONS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="embedded,gemma-3-270m,smollm2-135m")
    parser.add_argument("--variants", default="", help="only these variant names, separated by ';'")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/screen-variants"))
    parser.add_argument("--gemma-n", type=int, default=4)
    parser.add_argument("--gemma-length", type=int, default=32)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="no measuring: the table from --results")
    parser.add_argument("--at-shape", default="", help="time --variants at this shape of measure_sizes.py")
    parser.add_argument("--count", default="", help="only count each variant's FLOPs at these shapes (1B, 8B)")
    OPTIONS = parser.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "scripts"))
    if OPTIONS.at_shape:
        at_shape(OPTIONS.at_shape, OPTIONS.folder, [v for v in OPTIONS.variants.split(";") if v])
        return 0
    if OPTIONS.count:
        print(count_table(OPTIONS.count.split(",")))
        return 0
    OPTIONS.folder.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if OPTIONS.results is not None and OPTIONS.results.exists():
        rows = [json.loads(line) for line in OPTIONS.results.read_text().splitlines() if line.strip()]
    if not OPTIONS.table_only:
        only = [v for v in OPTIONS.variants.split(";") if v] or None
        for model in OPTIONS.models.split(","):
            rows += measure(model, OPTIONS.folder, only, OPTIONS.results)
    text = table(rows)
    print(text)
    if OPTIONS.write_docs:
        from measure_formats import write_blocks

        write_blocks(PAGE, {BLOCK_NAME: text})
    return 0


OPTIONS: argparse.Namespace

if __name__ == "__main__":
    raise SystemExit(main())

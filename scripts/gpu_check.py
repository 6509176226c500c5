"""The GPU check anyone can run: SmolLM2-135M on a CUDA device, in under five minutes there.

1. Every recipe (fp32, bf16, fp16, bnb-int8, bnb-nf4, bnb-fp4, rtn-int8, rtn-int4) loaded on the
   GPU and scanned as its shipped baseline was recorded (the baseline file's probe and knockout
   settings, a screen of 12), then gated against that baseline, recorded on the CPU: every
   invariant within the default tolerances (`gate.invariants.gate_all`).
2. The full exact knockout scan (all 270 heads, n 4, L 32, zero ablation) against the plain loop
   (one full forward per head), both on the GPU: wall times and the largest delta difference.
3. Peak GPU memory of each row (``torch.cuda.max_memory_allocated``).
4. Every serving format (`FORMATS`: the compressed-tensors recipes, a compressed-tensors W4A16
   and an NVFP4 (W4A4) checkpoint, a torchao int8 and an optimum-quanto int8 checkpoint written
   here; with ``$PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON`` set also gptq-int4-g64 and
   awq-int4-g64), which ship no baseline: recorded on the CPU and on the GPU in this run (no knockouts) and gated GPU
   against CPU. ``--formats none`` skips them.
5. One random-weight shape above 1B (``--size``, default Llama-3.2-1B's; seeded, built into a
   temporary folder by ``scripts/measure_sizes.py``, no download) scanned in bf16 as the default
   plan at size runs it (the atp screen, its top 8 exactly, n 8, L 64): its time and peak GPU
   memory, and that every head was screened and 8 knocked out exactly. ``--size none`` skips it.

Printed as one table. Run: ``python scripts/gpu_check.py`` (``--device cuda:1``, ``--recipes fp32,bnb-nf4``).

Exit codes: 0 every recipe held against its CPU baseline and the scan equals the plain loop;
1 something moved beyond tolerance (the table says what); 2 a usage or input error (one line on
stderr: SmolLM2 not installed, an unknown recipe); 3 no CUDA device here: nothing was checked
(one line on stderr).

Rung 1 (kappa and its 256-draw rotation null) runs on the CPU from the dequantized weights, as
on a CPU-only machine; the script lets torch use every core for it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

NO_GPU_EXIT = 3
HELD_OUT = {"seed": 1, "n": 4, "L": 32}  # the benchmarks' full-scan setting (docs/speed.md)
FORMATS = ("fp8-e4m3", "fp8-e4m3-dyn", "int8-w8a8", "ct-w4a16", "ct-nvfp4", "torchao-int8", "quanto-int8")
LLMC_FORMATS = ("gptq-int4-g64", "awq-int4-g64")  # with $PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON set


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    parser.add_argument("--recipes", default=None, help="comma list of recipes (default: every shipped baseline's)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma list of formats (or none)")
    parser.add_argument(
        "--size",
        default="llama-3.2-1b",
        help="a random-weight shape above 1B to scan in bf16 (scripts/measure_sizes.py; none: skip)",
    )
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was checked", file=sys.stderr
        )
        return NO_GPU_EXIT
    torch.set_num_threads(os.cpu_count() or 1)

    from pytest_circuits.errors import CircuitsError

    try:
        return run(args, torch)
    except CircuitsError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2


def _peak_reset(torch, device) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def _peak_mb(torch, device) -> float:
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def run(args, torch) -> int:
    from pytest_circuits.errors import CircuitsError
    from pytest_circuits.gate.invariants import gate_all
    from pytest_circuits.model.named import SHIPPED_BASELINES
    from pytest_circuits.model.recipes import RECIPES, parse_builds
    from pytest_circuits.record.store import BaselineStore
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.plain_loops import plain_knockout_deltas
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.settings import CircuitsSettings

    device = torch.device(args.device)
    if device.type != "cuda":
        raise CircuitsError(f"--device {args.device}: the GPU check runs on a CUDA device (cuda or cuda:N)")
    store = BaselineStore(SHIPPED_BASELINES)
    shipped = set(store.builds("smollm2-135m"))
    recipes = parse_builds(args.recipes) if args.recipes else [r.name for r in RECIPES.values() if r.name in shipped]
    rows, failed = [], False
    for recipe in recipes:
        baseline = store.read("smollm2-135m", recipe)
        probe, knockout = baseline["probe"], baseline["knockout"] or {}
        settings = CircuitsSettings(
            model="smollm2-135m",
            baselines=SHIPPED_BASELINES,  # a screened scan always measures the key heads of these files
            device=str(device),
            probe=RepeatSettings(probe["seed"], probe["n"], probe["L"]),
            knockout_mode=knockout.get("mode", "zero"),
            knockout_screen=knockout.get("screened"),
        )
        session = Run(settings)
        _peak_reset(torch, device)
        start = time.perf_counter()
        record = session.records.record(recipe)
        seconds = time.perf_counter() - start
        results = gate_all(baseline, record, session.tolerances, recipe, "CPU baseline")
        broken = [r.invariant for r in results if r.status == "failed"]
        held = [r for r in results if r.passed]
        ok = bool(held) and not broken
        failed |= not ok
        verdict = "pass" if ok else ("FAIL " + ", ".join(broken) if broken else "FAIL nothing compared")
        rows.append((recipe, f"{seconds:.1f}", f"{_peak_mb(torch, device):.0f}", f"{record['copy_loss']:.3f}", verdict))
        del session
        torch.cuda.empty_cache()

    session = Run(CircuitsSettings(model="smollm2-135m", device=str(device)))
    build = session.loaded.build("fp32")
    held_out = RepeatSettings(**HELD_OUT)
    _peak_reset(torch, device)
    start = time.perf_counter()
    scan = knockout_scan(build, held_out, progress=False)
    scan_s, scan_mb = time.perf_counter() - start, _peak_mb(torch, device)
    _peak_reset(torch, device)
    start = time.perf_counter()
    _, plain = plain_knockout_deltas(build, held_out)
    plain_s, plain_mb = time.perf_counter() - start, _peak_mb(torch, device)
    gap = max(abs(float(d) - plain[h]) for h, d in zip(scan["head"], scan["knockout_delta"]))
    equal = gap <= 1e-4
    failed |= not equal
    heads = len(scan)
    rows.append(
        (f"exact scan, {heads} heads", f"{scan_s:.1f}", f"{scan_mb:.0f}", "", f"{scan_s / plain_s:.2f}x the plain loop")
    )
    rows.append((f"plain loop, {heads} heads", f"{plain_s:.1f}", f"{plain_mb:.0f}", "", f"max |delta diff| {gap:.1e}"))

    if args.formats != "none":
        format_rows, format_failed = formats_rows(args.formats.split(","), torch, device)
        rows += format_rows
        failed |= format_failed
    if args.size != "none":
        row, ok = size_row(args.size, device, torch)
        rows.append(row)
        failed |= not ok

    name = torch.cuda.get_device_name(device)
    print(f"gpu_check: SmolLM2-135M on {device} ({name}), torch {torch.__version__}")
    header = ("what", "seconds", "peak MiB", "copy loss", "against the CPU baseline")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")
    return 1 if failed else 0


def format_spec(name: str, folder) -> str:
    """A recipe name, or ``NAME=DIR`` for a checkpoint written here by the format's own library."""
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model

    source = resolve_model("smollm2-135m").folder
    out = folder / name
    if name == "ct-w4a16":
        write_checkpoint(source, out, "W4A16", 64)
    elif name == "ct-nvfp4":  # the input's global scale from 8 seeded sequences of 64 tokens
        ids = torch.randint(0, 49152, (8, 64), generator=torch.Generator().manual_seed(0))
        write_checkpoint(source, out, "NVFP4", calibration=ids)
    elif name == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        config = TorchAoConfig(quant_type=Int8WeightOnlyConfig())
        AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, quantization_config=config).save_pretrained(
            out
        )
    elif name == "quanto-int8":
        from optimum.quanto import QuantizedModelForCausalLM, qint8

        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        QuantizedModelForCausalLM.quantize(model, weights=qint8, exclude="lm_head").save_pretrained(out)
    else:
        return name
    return f"{name}={out}"


def formats_rows(names: list[str], torch, device) -> tuple[list[tuple], bool]:
    """Each format recorded on the CPU and on ``device`` (no knockouts), GPU gated against CPU."""
    import tempfile
    from pathlib import Path

    from pytest_circuits.gate.invariants import gate_all
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import build_settings

    if os.environ.get("PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON"):
        names = [*names, *(n for n in LLMC_FORMATS if n not in names)]
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            spec = format_spec(name.strip(), Path(tmp))
            records = {}
            for where in ("cpu", str(device)):
                raw = {"model": "smollm2-135m", "builds": spec, "baselines": None}
                session = Run(build_settings(raw, Path(tmp), device=where))
                _peak_reset(torch, device)
                start = time.perf_counter()
                records[where] = session.records.record(name.strip(), knockout=False)
                seconds = time.perf_counter() - start
                del session
            results = gate_all(records["cpu"], records[str(device)], Tolerances(), name, "CPU record")
            broken = [r.invariant for r in results if r.status == "failed"]
            ok = any(r.passed for r in results) and not broken
            failed |= not ok
            verdict = "pass" if ok else ("FAIL " + ", ".join(broken) if broken else "FAIL nothing compared")
            copy = records[str(device)]["copy_loss"]
            rows.append(
                (f"{name} (format)", f"{seconds:.1f}", f"{_peak_mb(torch, device):.0f}", f"{copy:.3f}", verdict)
            )
            torch.cuda.empty_cache()
    return rows, failed


SIZE_SCREEN = 8  # exact knockouts after the screen in the size row


def size_row(shape: str, device, torch) -> tuple[tuple, bool]:
    """Scan a random-weight checkpoint of ``shape`` in bf16 on ``device`` (screen + top 8 exactly): the table row, ok."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    spec = importlib.util.spec_from_file_location("measure_sizes", Path(__file__).with_name("measure_sizes.py"))
    assert spec is not None and spec.loader is not None
    sizes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sizes)
    with tempfile.TemporaryDirectory(prefix="gpu-check-size-") as tmp:
        folder = Path(tmp) / shape
        gigabytes = sizes.build_checkpoint(shape, folder, seed=0) / 1e9
        settings = CircuitsSettings(
            model=str(folder),
            builds=("bf16",),
            reference="bf16",
            device=str(device),
            knockout_screen=SIZE_SCREEN,
            knockout_screen_method="atp",
        )
        session = Run(settings)
        _peak_reset(torch, device)
        start = time.perf_counter()
        record = session.records.record("bf16").data
        seconds = time.perf_counter() - start
        heads = record["heads"]
        exact = sum(h.get("knockout_delta") is not None for h in heads)
        screened = sum(h.get("knockout_estimate") is not None for h in heads)
        ok = exact == SIZE_SCREEN and screened == len(heads)
        verdict = f"{exact} exact, {screened}/{len(heads)} screened" + ("" if ok else ": FAIL")
        label = f"{shape} bf16 ({gigabytes:.1f} GB, random), scan"
        return (label, f"{seconds:.1f}", f"{_peak_mb(torch, device):.0f}", f"{record['copy_loss']:.3f}", verdict), ok


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Peak memory of a long repeat probe: the 1B shape (random weights, `measure_sizes.build_checkpoint`)
at 1k, 4k and 8k tokens and SmolLM2-135M at 4k, each in a fresh process (`measure_sizes.run_stage`).

One sequence (n 1) of ``2L + 1`` tokens (BOS, then the segment twice), bf16 weights, one thread
recommended (``OMP_NUM_THREADS=1``). The probe runs in blocks of queries (`rungs.query_blocks`)
once one forward's attention pattern or logits would exceed 256 MiB; the table says how many
queries a block held. Writes the table into docs/kv-cache.md's ``long-probe`` block with
``--write-docs``.

    OMP_NUM_THREADS=1 python scripts/measure_long_probe.py --write-docs
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "kv-cache.md"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def block_of(folder: Path, L: int) -> int:
    """Queries per block of the probe of the model in ``folder`` at segment length ``L`` (n 1)."""
    from pytest_circuits.model.families import family_and_geometry
    from pytest_circuits.model.loading import read_config
    from pytest_circuits.rungs.query_blocks import query_block

    _, geometry = family_and_geometry(read_config(folder, False, str(folder)))
    return query_block(geometry, 1, 2 * L + 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,4096", help="segment lengths L on the 1B shape")
    parser.add_argument("--smollm2-lengths", default="2048", help="segment lengths L on SmolLM2-135M")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/circuits-long-probe"))
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/kv-cache.md")
    args = parser.parse_args(argv)
    sizes = _script("measure_sizes")
    measure = _script("measure_formats")
    from pytest_circuits.model.loading import resolve_model

    runs: list[tuple[str, Path, int]] = []
    one_b = args.folder / "llama-3.2-1b"
    if args.lengths:
        if not (one_b / "config.json").is_file():
            sizes.build_checkpoint("llama-3.2-1b", one_b, seed=0)
        runs += [("Llama-3.2-1B shape (random)", one_b, int(L)) for L in args.lengths.split(",")]
    if args.smollm2_lengths:
        smol = resolve_model("smollm2-135m").folder
        runs += [("SmolLM2-135M", Path(smol), int(L)) for L in args.smollm2_lengths.split(",")]
    lines = [
        "| model | L (tokens back) | sequence | queries per block | peak RSS | after load | CPU s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, folder, L in runs:
        options = sizes.parse_options(["--probe-n", "1", "--probe-length", str(L), "--build", "bf16"])
        row = sizes.run_stage(label, folder, "probe", options)
        if "error" in row:
            raise SystemExit(f"{label} L={L}: {row['error']}")
        line = (
            f"| {label} | {L:,} | {2 * L + 1:,} | {block_of(folder, L):,} | {row['rss'] / 1e9:.2f} GB | "
            f"{row['load_rss'] / 1e9:.2f} GB | {row['cpu']:.0f} | {row['wall']:.0f} |"
        )
        print(line, flush=True)
        lines.append(line)
    shutil.rmtree(one_b, ignore_errors=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_docs:
        given = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--write-docs"]
        shown = " ".join(measure.shown_arguments(given, ("--folder",)))
        command = f"`OMP_NUM_THREADS=1 python scripts/measure_long_probe.py{' ' + shown if shown else ''}`"
        measure.write_blocks(DOCS, {"long-probe": f"{command}\n\n{text}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

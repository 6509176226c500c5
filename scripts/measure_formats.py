#!/usr/bin/env python
"""Measure each serving-format build against fp32: the gate's figures beside ordinary-text loss.

Per build: copy loss, its change against fp32 with the 95% paired interval (every build sees the
same probe tokens), the fp32 induction heads' prefix-matching scores (the top three, then in the
build), the largest fp32 knockout delta and that head's delta in the build, the gate's verdict
against fp32 (`gate_all` with the default tolerances; the failing invariants named), and the mean
next-token loss on held-out text (the docstrings of `calibrated.HELD_OUT_MODULES`, never used for
calibration; a model without a tokenizer: n/a). Prints a Markdown table (docs/formats.md).

``--stored-reference`` gates against the model's stored fp32 baseline, as ``circuits gate`` does,
instead of recording fp32 here. A build named ``w4a16-rtn-g<N>`` (no path) is a compressed-tensors
W4A16 checkpoint with round-to-nearest (min-max) scales per group of N columns, written by
`compressed.write_checkpoint` into ``--records`` and loaded as an external build: the
round-to-nearest control for ``gptq-int4-g<N>`` and ``awq-int4-g<N>`` on the same grid.
``--stored-builds`` reads each recipe build that has a stored baseline from it (recorded by
``circuits record`` with the same settings; its s column is 0). ``--records`` keeps each build's record (JSON) and held-out loss, so a stopped run resumes; ``--write-baselines``
also stores the record of each recipe build that has no baseline yet as its baseline (the same
record ``circuits record`` writes with these settings).

    python scripts/measure_formats.py --builds fp32,fp8-e4m3,fp8-e4m3-dyn,int8-w8a8,rtn-int4
    python scripts/measure_formats.py --probe-length 127 --builds fp32+kv-int2,bf16+kv-q4_0  # KV caches
    python scripts/measure_formats.py --model smollm2-135m --stored-reference --knockout-screen 12 \\
        --knockout-screen-method atp --builds fp8-e4m3,fp8-e4m3-dyn,int8-w8a8,rtn-int4,\\
        w4a16-rtn-g64,gptq-int4-g64,awq-int4-g64

Every measured table of docs/formats.md and docs/kv-cache.md is one entry of `PLANS` (its page,
its block and its arguments): ``--all --write-docs`` runs each and rewrites its block, ``--only
BLOCK,...`` some of them (the long-probe block runs scripts/measure_long_probe.py). A build named
``torchao-int8``, ``torchao-int8-dyn``, ``quanto-int8`` or ``quanto-int4`` (no path) is a
checkpoint of the model saved by that library (`LIBRARY_CHECKPOINTS`), written once into ``--records``.

    OMP_NUM_THREADS=1 python scripts/measure_formats.py --all --write-docs
``--llama-cpp Q8_0,Q4_0`` measures llama.cpp in the loop instead (`llama_table`): each GGUF file of
the model (`gguf_quant.cached_gguf`) run by llama.cpp with each cache of ``--caches`` against the
torch dequantisation of the same file with the same cache simulated (f16, llama.cpp's default, is
full precision in torch), on the same sequences; and against fp32 in torch, gated on copy_loss
(the one probe invariant llama.cpp's logits can gate). The cache's part of each gap is the gap less the
f16 row's (llama.cpp's activations, quantized by its kernels), per sequence. ``--probe-n N`` probes N
sequences (default the option's, 8); it is part of the command shown above a table, and of the
record folder (``--records``), so a rerun of that command measures the same sequences.

    python scripts/measure_formats.py --model smollm2-135m --probe-length 64 --llama-cpp Q8_0,Q4_0
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

from pytest_circuits.gate.invariants import gate_all, key_heads
from pytest_circuits.gate.stats import mean_interval, paired_interval
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.model.calibrated import HELD_OUT_MODULES, text_ids
from pytest_circuits.model.quantized_cache import decode_cache_of
from pytest_circuits.model.recipes import RECIPES
from pytest_circuits.record.figures import sequences_key
from pytest_circuits.record.store import dumps
from pytest_circuits.run.run import Run
from pytest_circuits.rungs.query_blocks import block_losses, forward_blocks
from pytest_circuits.settings import build_settings

HELD_OUT_ROWS, HELD_OUT_LENGTH = 8, 256
BLOCK = re.compile(r"(<!-- measured: ([\w.-]+) -->\n)(.*?)(<!-- /measured: \2 -->)", re.S)
RTN_CHECKPOINT = re.compile(r"w4a16-rtn-g(\d+)$")
LIBRARY_CHECKPOINTS = ("torchao-int8", "torchao-int8-dyn", "quanto-int8", "quanto-int4")
KV_BUILDS = (
    "bf16,bf16+kv-fp8-e4m3,bf16+kv-fp8-e5m2,bf16+kv-int8,bf16+kv-int4,bf16+kv-int2,bf16+kv-int2-r{w},"
    "bf16+kv-q8_0,bf16+kv-q5_1,bf16+kv-q5_0,bf16+kv-q4_1,bf16+kv-q4_0,bf16+kv-iq4_nl,"
)
KV_TINY = KV_BUILDS.format(w=32) + "rtn-int4,rtn-int4+kv-fp8-e4m3,rtn-int4+kv-int4,rtn-int4+kv-q8_0,rtn-int4+kv-q4_0"
KV_SMOLLM2 = KV_BUILDS.format(w=64) + "bnb-nf4,bnb-nf4+kv-fp8-e4m3,bnb-nf4+kv-q8_0,bnb-nf4+kv-q4_0"
KV_QUANTO = "bf16,bf16+kv-quanto-int4-r{w},bf16+kv-quanto-int2-r{w},bf16+kv-int4-r{w},bf16+kv-int2-r{w}"
FORMATS_TINY = (
    "fp32,fp8-e4m3,fp8-e4m3-dyn,int8-w8a8,rtn-int8,rtn-int4,w4a16-rtn-g128,gptq-int4,awq-int4,w4a16-rtn-g32,"
    "torchao-int8,torchao-int8-dyn,quanto-int8,quanto-int4,awq-int4-g64,gptq-int4-g64"
)
FORMATS_SMOLLM2 = "w4a16-rtn-g64,gptq-int4-g64,awq-int4-g64,rtn-int4,fp8-e4m3-dyn,int8-w8a8,fp8-e4m3"
SMOLLM2 = ["--model", "smollm2-135m"]
LLAMA_SMOLLM2 = [*SMOLLM2, "--llama-cpp", "Q8_0"]
LLAMA_FILES = "Q8_0,Q4_0"
# SmolLM2's llama tables: sequences (--probe-n) and the caches measured with -qdot and one-ulp bumps (--spread);
# each of those is another torch probe of the whole plan (L 512, n 32: about 6 minutes each here)
LLAMA_N_L64, LLAMA_SPREAD_L64, LLAMA_N_L512, LLAMA_SPREAD_L512 = "256", "q4_1", "32", "none"
RECORDS = Path("/tmp/pytest-circuits-formats")
PLANS: dict[str, tuple[str, list[str]]] = {  # block: (page, arguments); each fact of a table declared here
    "formats-tiny": ("docs/formats.md", ["--builds", FORMATS_TINY]),
    "formats-smollm2": (
        "docs/formats.md",
        [*SMOLLM2, "--stored-reference", "--stored-builds", "--no-knockout", "--builds", FORMATS_SMOLLM2],
    ),
    "kv-tiny-L32": ("docs/kv-cache.md", ["--probe-length", "32", "--builds", KV_TINY]),
    "kv-tiny-L64": ("docs/kv-cache.md", ["--probe-length", "64", "--builds", KV_TINY]),
    "kv-smollm2-L64": ("docs/kv-cache.md", [*SMOLLM2, "--no-knockout", "--probe-length", "64", "--builds", KV_SMOLLM2]),
    "kv-smollm2-L512": (
        "docs/kv-cache.md",
        [*SMOLLM2, "--no-knockout", "--probe-length", "512", "--builds", KV_SMOLLM2],
    ),
    "kv-quanto-tiny": (  # transformers' QuantizedCache reads in decode mode only: no knockouts
        "docs/kv-cache.md",
        ["--no-knockout", "--probe-length", "64", "--builds", KV_QUANTO.format(w=32)],
    ),
    "kv-quanto-smollm2": (
        "docs/kv-cache.md",
        [*SMOLLM2, "--no-knockout", "--probe-length", "64", "--builds", KV_QUANTO.format(w=32)],
    ),
    "long-probe": ("docs/kv-cache.md", []),  # scripts/measure_long_probe.py
    # llama.cpp in the loop (the llama extra): its kernels and caches against torch on the same GGUF file
    "llama-tiny-L32": ("docs/kv-cache.md", ["--llama-cpp", LLAMA_FILES, "--probe-length", "32"]),
    "llama-tiny-L64": ("docs/kv-cache.md", ["--llama-cpp", LLAMA_FILES, "--probe-length", "64"]),
    "llama-smollm2-L64": (  # n = 256: a 4-bit cache's mean to about +-0.033 against llama.cpp (64: +-0.065)
        "docs/kv-cache.md",
        [*LLAMA_SMOLLM2, "--probe-length", "64", "--probe-n", LLAMA_N_L64, "--spread", LLAMA_SPREAD_L64],
    ),
    "llama-smollm2-L512": (
        "docs/kv-cache.md",
        [*LLAMA_SMOLLM2, "--probe-length", "512", "--probe-n", LLAMA_N_L512, "--spread", LLAMA_SPREAD_L512],
    ),
}


@torch.no_grad()
def held_out_loss(session: Run, name: str) -> float | None:
    """Mean next-token cross-entropy (nats) of the build on the held-out text."""
    ids = text_ids(session.loaded.source.folder, HELD_OUT_MODULES, HELD_OUT_ROWS, HELD_OUT_LENGTH)
    if ids is None:
        return None
    model = session.loaded.build(name).model
    decode = decode_cache_of(model)
    if decode is not None:  # transformers' QuantizedCache: one token at a time through it, as the probe
        losses = []
        for row in ids:
            parts = [block_losses(lg, row[None], s) for s, lg in forward_blocks(model, row[None], 1, decode.new())]
            losses.append(float(torch.cat(parts, dim=1).mean()))
    else:
        losses = [float(model(input_ids=row[None], labels=row[None], use_cache=False).loss) for row in ids]
    return sum(losses) / len(losses)


def write_blocks(page: Path, blocks: dict[str, str]) -> None:
    """Rewrite each ``<!-- measured: NAME -->`` ... ``<!-- /measured: NAME -->`` block of ``page`` named in ``blocks``."""
    text = page.read_text(encoding="utf-8")
    missing = [name for name in blocks if f"<!-- measured: {name} -->" not in text]
    if missing:
        raise SystemExit(f"{page}: no block for {', '.join(missing)}; add <!-- measured: NAME --> ... markers")
    page.write_text(
        BLOCK.sub(lambda m: m.group(1) + blocks.get(m.group(2), m.group(3)) + m.group(4), text), encoding="utf-8"
    )


def shown_arguments(argv: list[str], local: tuple[str, ...] = ("--records", "--write-docs")) -> list[str]:
    """The command's arguments as a page shows them: without this machine's record folder or the page."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in local:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in local)):
            shown.append(arg)
    return shown


def build_specs(builds: str, model: str, records: Path) -> str:
    """``--builds`` with each ``w4a16-rtn-g<N>`` made a NAME=PATH of a checkpoint written (once) here."""
    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model

    specs = []
    for name in builds.split(","):
        match = RTN_CHECKPOINT.match(name)
        folder = records / f"{name}-checkpoint"
        if match:
            if not (folder / "config.json").is_file():
                write_checkpoint(resolve_model(model).folder, folder, "W4A16", int(match.group(1)))
            name = f"{name}={folder}"
        elif name in LIBRARY_CHECKPOINTS:
            if not (folder / "config.json").is_file():
                write_library_checkpoint(name, resolve_model(model).folder, folder)
            name = f"{name}={folder}"
        specs.append(name)
    return ",".join(specs)


def write_library_checkpoint(name: str, model: Path, folder: Path) -> None:
    """``model`` quantized and saved by torchao (int8 weight-only, int8 dynamic) or optimum-quanto
    (int8, int4; ``lm_head`` left out), as tests/test_formats.py makes them."""
    from transformers import AutoModelForCausalLM

    if name.startswith("torchao"):
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        config = Int8DynamicActivationInt8WeightConfig() if name.endswith("-dyn") else Int8WeightOnlyConfig()
        quantization = TorchAoConfig(quant_type=config)
        AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, quantization_config=quantization
        ).save_pretrained(folder)
        return
    from optimum.quanto import QuantizedModelForCausalLM, qint4, qint8

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    weights = qint8 if name == "quanto-int8" else qint4
    QuantizedModelForCausalLM.quantize(loaded, weights=weights, exclude="lm_head").save_pretrained(folder)


def change(before: dict, after: dict) -> str:
    """Copy loss change with its 95% paired interval: ``+0.012 [+0.003, +0.021]``."""
    d = after["copy_loss"] - before["copy_loss"]
    key = sequences_key("copy_loss")
    interval = paired_interval(before[key], after[key]) if key in before and key in after else None
    return f"{d:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else f"{d:+.3f}"


def run_plans(only: str | None, write: bool, records: str | None = None) -> None:
    """Each of `PLANS` (or those named in ``only``), one after the other; ``write``: into its block;
    ``records``: the record folder of every run (default each run's own)."""
    chosen = only.split(",") if only else list(PLANS)
    unknown = [name for name in chosen if name not in PLANS]
    if unknown:
        raise SystemExit(f"--only: no block {', '.join(unknown)}; the blocks are {', '.join(PLANS)}")
    for block in chosen:
        page, arguments = PLANS[block]
        print(f"== {page}:{block}", flush=True)
        if block == "long-probe":
            script = Path(__file__).resolve().parent / "measure_long_probe.py"
            command = [sys.executable, str(script), *(["--write-docs"] if write else [])]
            subprocess.run(command, check=True)
            continue
        kept = ["--records", records] if records else []
        main([*arguments, *kept, *(["--write-docs", f"{page}:{block}"] if write else [])])


LLAMA_COLUMNS = (  # short: the page's column holds eleven (each interval 95%, the differences paired)
    "| weights | cache | llama.cpp copy loss | torch, same file and cache | llama.cpp - torch | the cache's part "
    "| -qdot: llama.cpp - torch | one-ulp spread: sd (mean) | llama.cpp - fp32 torch | copy_loss vs fp32 | s |"
)


def probe_figures(probe) -> dict:
    """A probe's copy loss and gain with their per-sequence values, as a record holds them."""
    from pytest_circuits.run.assemble import sampled_model_figures

    return {**probe.model_figures(), **sampled_model_figures(probe)}


LOADED: dict = {}  # external build spec -> its LoadedBuild, loaded once for every cache of `llama_table`


def torch_pair(source, spec: str, kv, settings, bumped: bool = False) -> dict:
    """Torch's probe figures of external GGUF build ``spec`` with cache ``kv`` simulated (None: none)."""
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.kv_cache import attach_kv_cache, cache_of, one_ulp_bumps
    from pytest_circuits.model.recipes import parse_build_spec
    from pytest_circuits.rungs.probe import run_repeat_probe

    build = LOADED.get(spec)
    if build is None or (kv is None and cache_of(build.model) is not None):  # a cache, once put in, stays
        build = LOADED[spec] = load_external_build(source, parse_build_spec(spec), "cpu")
    build = build if kv is None else attach_kv_cache(build, kv)  # replaces the cache put in before
    with one_ulp_bumps() if bumped else nullcontext():
        return probe_figures(run_repeat_probe(build, settings))


def llama_run(source, spec: str, kv, settings) -> dict:
    """llama.cpp's probe figures of GGUF build ``spec`` with its cache ``kv`` (None: its f16 default)."""
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.llama_engine import threads
    from pytest_circuits.model.recipes import parse_build_spec
    from pytest_circuits.rungs.llama_probe import llama_repeat_probe

    build_spec = parse_build_spec(spec)
    build = LOADED.get(spec) or load_external_build(source, build_spec, "cpu")
    path = Path(str(build_spec.path))
    return probe_figures(llama_repeat_probe(path, build.tokens, build.geometry, settings, kv, threads()))


def cache_part(ours: dict, theirs: dict, ours_f16: dict, theirs_f16: dict) -> str:
    """The cache's part of llama.cpp's gap to torch: per sequence, (llama.cpp - torch with the cache
    simulated) - (llama.cpp - torch with f16, the engine's activations alone), its mean with the 95%
    interval of those differences: ``-0.012 [-0.040, +0.016]``."""
    key = sequences_key("copy_loss")
    parts = [(a - b) - (c - d) for a, b, c, d in zip(ours[key], theirs[key], ours_f16[key], theirs_f16[key])]
    mean = (ours["copy_loss"] - theirs["copy_loss"]) - (ours_f16["copy_loss"] - theirs_f16["copy_loss"])
    interval = mean_interval(parts)
    return f"{mean:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else f"{mean:+.3f}"


def spread(plain: dict, bumped: dict) -> str:
    """``sd (mean)`` of the per-sequence copy-loss change a one-ulp bump makes."""
    key = sequences_key("copy_loss")
    moved = [b - a for a, b in zip(plain[key], bumped[key])]
    mean = sum(moved) / len(moved)
    sd = (sum((m - mean) ** 2 for m in moved) / max(1, len(moved) - 1)) ** 0.5
    return f"{sd:.3f} ({mean:+.3f})"


def cached_figures(records: Path, name: str, measure) -> dict:
    """``measure()``'s figures and the seconds it took, kept in ``records`` as ``llama-NAME.json``."""
    path = records / f"llama-{name}.json"
    if not path.is_file():
        start = time.perf_counter()
        figures = measure()
        path.write_text(json.dumps({**figures, "seconds": time.perf_counter() - start}))
    return json.loads(path.read_text())


def llama_table(args, records: Path) -> list[str]:
    """Rows of llama.cpp's copy loss against torch's on the same GGUF file (module doc, ``--llama-cpp``):
    torch's simulation of the cache as the build runs it, with ``-qdot`` (Q quantized as llama.cpp's
    dot product takes it), and its one-ulp spread (`kv_cache.one_ulp_bumps`), the floor under any gap."""
    from pytest_circuits.gate.invariants import evaluate
    from pytest_circuits.model.gguf_quant import cached_gguf
    from pytest_circuits.model.kv_formats import parse_kv
    from pytest_circuits.model.llama_engine import DEFAULT_CACHE, llama_cpp_version, threads
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.options import parse_value
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    source = resolve_model(args.model)
    settings = RepeatSettings(
        seed=0, n=args.probe_n or parse_value("probe-n", None), L=args.probe_length or parse_value("probe-length", None)
    )

    cached = partial(cached_figures, records)

    def record_fp32() -> dict:  # a whole record: the gate's invariants read records (`record.schema.Record`)
        raw = {"model": args.model, "builds": "fp32", "probe-length": settings.L, "probe-n": settings.n}
        run = Run(build_settings(raw, Path("baselines"), device="cpu"))
        return json.loads(dumps(run.records.record("fp32", knockout=False).data))

    fp32 = cached("fp32-record", record_fp32)
    fp32.pop("seconds", None)
    lines = [
        f"{args.model}, L = {settings.L}, n = {settings.n}: fp32 copy loss in torch {fp32['copy_loss']:.4f}; "
        f"llama-cpp-python {llama_cpp_version()}, {threads()} threads",
        "",
        LLAMA_COLUMNS,
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in args.llama_cpp.split(","):
        spec = f"{kind.lower()}={cached_gguf(args.model, kind)}"
        for cache in args.caches.split(","):
            kv = None if cache == DEFAULT_CACHE else parse_kv(cache)
            ours = cached(f"{kind}-{cache}.llama", partial(llama_run, source, spec, kv, settings))
            theirs = cached(f"{kind}-{cache}.torch", partial(torch_pair, source, spec, kv, settings))
            part = "n/a (activations)"
            if kv is not None:  # the f16 row's gap is llama.cpp's activations alone: measured once per file
                ours_f16 = cached(f"{kind}-{DEFAULT_CACHE}.llama", partial(llama_run, source, spec, None, settings))
                theirs_f16 = cached(f"{kind}-{DEFAULT_CACHE}.torch", partial(torch_pair, source, spec, None, settings))
                part = cache_part(ours, theirs, ours_f16, theirs_f16)
            seconds = [theirs["seconds"]]
            qdot = floor = "n/a (no cache)" if kv is None else "not measured (--spread)"
            if kv is not None and (args.spread is None or cache in args.spread.split(",")):
                with_q = cached(
                    f"{kind}-{cache}.qdot", partial(torch_pair, source, spec, parse_kv(f"{cache}-qdot"), settings)
                )
                bumped = cached(f"{kind}-{cache}.bumped", partial(torch_pair, source, spec, kv, settings, True))
                qdot, floor = change(with_q, ours), spread(theirs, bumped)
                seconds += [with_q["seconds"], bumped["seconds"]]
            took = "-" if None in seconds else f"{sum(seconds):.0f}"
            low, high = ours["copy_loss_interval"]
            # llama.cpp's probe figures in fp32's record: the copy_loss invariant reads only those
            verdict = evaluate("copy_loss", fp32, {**fp32, **ours}, Tolerances(), f"{kind} {cache}", "fp32")
            torch_cache = "full precision" if kv is None else cache
            say = "pass" if verdict.status == "passed" else "FAIL" if verdict.status == "failed" else verdict.status
            lines.append(
                f"| {kind} | {cache} | {ours['copy_loss']:.4f} [{low:.4f}, {high:.4f}] | "
                f"{theirs['copy_loss']:.4f} ({torch_cache}) | {change(theirs, ours)} | {part} | {qdot} | {floor} | "
                f"{change(fp32, ours)} | {say} | {took} |"
            )
            print(lines[-1], flush=True)
    return lines


def records_folder(model: str, length: int | None, n: int | None) -> str:
    """The record folder of a plan under ``--records``: one per model, probe length and number of sequences."""
    return model + (f"-L{length}" if length else "") + (f"-n{n}" if n else "")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-induction")
    parser.add_argument("--builds", default="fp32,fp8-e4m3,fp8-e4m3-dyn,int8-w8a8,rtn-int4")
    parser.add_argument("--stored-reference", action="store_true", help="gate against the stored fp32 baseline")
    parser.add_argument("--stored-builds", action="store_true", help="read a recipe with a stored baseline from it")
    parser.add_argument("--knockout-screen", default=None, help="screen of N heads (SmolLM2: 12)")
    parser.add_argument("--knockout-screen-method", default=None, help="atp, atp* or atp*gd (SmolLM2's: atp)")
    parser.add_argument("--no-knockout", action="store_true", help="skip rung 2 (knockout deltas)")
    parser.add_argument("--probe-length", type=int, default=None, help="segment length L (default: the option's)")
    parser.add_argument("--probe-n", type=int, default=None, help="number of probe sequences (default: the option's)")
    parser.add_argument("--all", action="store_true", help="every measured table of the pages: each plan of PLANS")
    parser.add_argument("--only", default=None, help="some of the plans, a comma list of blocks: " + ", ".join(PLANS))
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const="",
        default=None,
        metavar="PAGE:BLOCK",
        help="also write the table into that block (with --all or --only: each plan's table into its own block)",
    )
    parser.add_argument("--records", type=Path, default=None, help=f"record cache (default {RECORDS})")
    parser.add_argument(
        "--write-baselines", action="store_true", help="store a recipe's record as its missing baseline"
    )
    parser.add_argument(
        "--llama-cpp", default=None, metavar="TYPES", help="GGUF types (Q8_0,Q4_0): llama.cpp against torch instead"
    )
    parser.add_argument("--caches", default="f16,q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl", help="with --llama-cpp: caches")
    parser.add_argument(
        "--spread",
        default=None,
        help="with --llama-cpp: the caches measured with -qdot and one-ulp bumps (default all; none: none)",
    )
    args = parser.parse_args(argv)
    if args.all or args.only:
        run_plans(args.only, args.write_docs is not None, None if args.records is None else str(args.records))
        return
    if args.write_docs == "":
        parser.error("--write-docs needs PAGE:BLOCK, or --all / --only to write each plan's own block")
    records = (args.records or RECORDS) / records_folder(args.model, args.probe_length, args.probe_n)
    records.mkdir(parents=True, exist_ok=True)
    if args.llama_cpp:
        lines = llama_table(args, records)
        if args.write_docs:
            write_docs(args.write_docs, lines, argv)
        return
    raw = {
        "model": args.model,
        "builds": build_specs(args.builds, args.model, records),
        "knockout-screen": args.knockout_screen,
        "knockout-screen-method": args.knockout_screen_method,
        "probe-length": args.probe_length,
        "probe-n": args.probe_n,
    }
    session = Run(build_settings({k: v for k, v in raw.items() if v}, Path("baselines"), device="cpu"))
    knockout = not args.no_knockout

    def record_of(name: str) -> tuple[dict, float]:
        """The build's record and the seconds it took (loading, rung 1, probe, knockouts)."""
        if args.stored_builds and name in RECIPES and session.baselines.path(name).is_file():
            return session.baselines.load(name).data, 0.0
        path = records / f"{name}{'' if knockout else '.no-knockout'}.json"
        seconds = path.with_suffix(".seconds")
        if not path.is_file():
            start = time.perf_counter()
            record = session.records.record(name, knockout=knockout).data
            seconds.write_text(f"{time.perf_counter() - start:.0f}")
            path.write_text(dumps(record))
            if args.write_baselines and knockout and name in RECIPES and not session.baselines.path(name).is_file():
                print(f"wrote {session.baselines.store.write(session.loaded.model_name, name, record)[0]}", flush=True)
        return json.loads(path.read_text()), float(seconds.read_text())

    fp32, _ = (session.baselines.load("fp32").data, 0.0) if args.stored_reference else record_of("fp32")
    induction = key_heads(fp32, "prefix_matching", 3, 0.0)
    knocked = key_heads(fp32, "knockout_delta", 1, 0.0)
    head = {r["head"]: r for r in fp32["heads"]}
    listed = ", ".join(f"{h} {head[h]['prefix_matching']:.3f}" for h in induction)
    where = f"stored baseline {session.baselines.path('fp32')}" if args.stored_reference else "recorded here"
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"{args.model}: fp32 ({where}) induction heads (prefix matching) {listed}")
    say("")
    say(
        "| build | copy loss [interval] | change vs fp32 [95% paired] | induction heads | top knockout delta "
        "| held-out text loss | gate vs fp32 | s (record) |"
    )
    say("|---|---|---|---|---|---|---|---|")
    names = list(dict.fromkeys(["fp32", *session.settings.builds]))
    for name in names:
        record, seconds = (fp32, 0.0) if name == "fp32" else record_of(name)
        rows = {r["head"]: r for r in record["heads"]}
        low, high = record["copy_loss_interval"]
        scores = " ".join(f"{rows[h]['prefix_matching']:.3f}" for h in induction)
        deltas = " ".join(f"{h} {rows[h]['knockout_delta']:.3f}" for h in knocked if rows[h].get("knockout_delta"))
        deltas = deltas or "not measured"
        cached = records / f"{name}.held-out"
        if not cached.is_file():
            cached.write_text(json.dumps(held_out_loss(session, name)))
        loss = json.loads(cached.read_text())
        if name == "fp32":
            verdict, moved = "reference", "0"
        else:
            results = gate_all(fp32, record, Tolerances(), name, "fp32")
            broken = [r.invariant for r in results if r.status == "failed"]
            verdict = "pass" if broken == [] and any(r.passed for r in results) else "FAIL " + ", ".join(broken)
            moved = change(fp32, record)
        text = "n/a" if loss is None else f"{loss:.3f}"
        say(
            f"| {name} | {record['copy_loss']:.4f} [{low:.4f}, {high:.4f}] | {moved} | {scores} | {deltas} | {text} "
            f"| {verdict} | {seconds:.0f} |"
        )
    if args.write_docs:
        write_docs(args.write_docs, lines, argv)


def write_docs(where: str, lines: list[str], argv: list[str]) -> None:
    """The table into block ``PAGE:BLOCK``, under the command that regenerates it (``argv`` shown)."""
    page, _, block = where.partition(":")
    command = "python scripts/measure_formats.py " + " ".join(shown_arguments(argv))
    write_blocks(Path(page), {block: "\n".join([f"`{command}`", "", *lines]) + "\n"})


if __name__ == "__main__":
    main()

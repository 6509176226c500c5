"""Time and memory of `circuits scan` at the sizes users ship, measured on random weights of real shapes.

Builds seeded random-weight checkpoints with the exact shapes of Llama-3.2-1B, Llama-3.2-3B,
Qwen3-4B and Llama-3-8B, and of MiniCPM3-4B (latent attention) and Falcon-H1-1.5B (Mamba-2 beside
attention) for issue 52's block (``--block stacks``) (bf16, written tensor by tensor, never the whole model in memory;
no download), then runs each rung of the scan in a fresh process and reads, per rung, wall
and CPU seconds, the process's peak resident memory (``ru_maxrss``: every page the process
ever held, not tracemalloc's Python allocations), the FLOPs counted from the shapes and the
rate achieved. Writes the table into ``docs/scale.md`` (between its ``measured`` markers).

Run (about an hour for the four shapes on 2 cores):

    python scripts/measure_sizes.py --shapes llama-3.2-1b,llama-3.2-3b,qwen3-4b,llama-3-8b --write-docs

Checkpoints go to ``--folder`` (default ``/work/scratch/sizes``, or ``$CIRCUITS_SIZES_DIR``) and are
deleted after their rows unless ``--keep``. ``--probe-n``/``--probe-length`` shrink the probe
(the table says which was used). One rung alone: ``--rungs rung1,probe``. With ``--results FILE`` every
run appends its rows there and the table is made from all of them (each shape's latest run of each rung).

Rows (each a fresh process that loads the build first; its load is timed apart):

* ``load``: the build loaded and its per-head decomposition self-checked;
* ``rung 1``: kappa of every head and its 32-draw rotation null (W_U W_E in vocabulary blocks, one
  layer's W_V, W_O at a time);
* ``probe``: the seeded repeat probe (n x 2L tokens, attention patterns per layer);
* ``screen + exact``: rung 2 as the default plan at size runs it: the AtP screen over every head, then
  exact knockouts of its top ``--screen`` heads;
* ``scan``: the whole ``circuits scan --knockout-screen K`` in one process (its peak is the goal's figure);
* ``gate``: the whole ``circuits gate`` of the build against the record ``scan`` wrote;
* ``gate-key``: the same against that record with ``--key-heads`` heads (300) made key heads, chosen at
  random (seeded) and given the look-1 knockout deltas of SmolLM2-135M's fp32 baseline's key heads
  (`key_heads_record`): random weights have no key head, a trained model has hundreds at 8B, and a
  gate knocks out each exactly. The record holds look 1 only, so the gate decides there. With
  ``--change-screen F`` the gate runs the change screen (``--tol change_screen=F``) and the record's
  plain-AtP estimates of ``--confirmed C`` of those heads (chosen at random) are moved by 1000 nats, so
  the screen knocks out exactly C of them: the time of a gate whose estimate moved for C key heads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

LLAMA_3_2 = dict(  # what Llama-3.2-1B and -3B share
    model_type="llama",
    intermediate_size=8192,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
)
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {
        **LLAMA_3_2,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "head_dim": 64,
    },
    "llama-3.2-3b": {
        **LLAMA_3_2,
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "head_dim": 128,
    },
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
}
STACK_SHAPES: dict[str, dict] = {  # issue 52: a latent-attention and a hybrid release (docs/scale.md, "Latent ...")
    "minicpm3-4b": dict(  # openbmb/MiniCPM3-4B's config.json (transformers' MiniCPM3Config defaults are these)
        model_type="minicpm3",
        hidden_size=2560,
        intermediate_size=6400,
        num_hidden_layers=62,
        num_attention_heads=40,
        num_key_value_heads=40,
        q_lora_rank=768,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        vocab_size=73448,
        tie_word_embeddings=True,
        scale_emb=12,
        scale_depth=1.4,
        dim_model_base=256,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
    ),
    "falcon-h1-1.5b": dict(  # tiiuae/Falcon-H1-1.5B-Base's config.json; its multipliers left at 1 (random weights)
        model_type="falcon_h1",
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
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
}
SHAPES.update(STACK_SHAPES)
RUNGS = ("load", "rung1", "probe", "screen", "scan", "gate", "gate-key")
INIT_STD = 0.02  # transformers' initializer_range: the random weights' scale
SHARD_BYTES = 2 * 1024**3  # a safetensors shard holds at most this many bytes
ROW_CHUNK = 1 << 24  # entries drawn at once (float32 scratch of 64 MB)
ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "scale.md"
BEGIN, END = "<!-- measured: begin (scripts/measure_sizes.py) -->", "<!-- measured: end -->"
STACK_BEGIN, STACK_END = (
    "<!-- measured: begin (scripts/measure_sizes.py --block stacks) -->",
    "<!-- measured: end (stacks) -->",
)
GIB = 1024**3


# ---------------------------------------------------------------- random checkpoints


def shape_config(name: str):
    """The transformers config of shape ``name`` (bf16, eager attention)."""
    from transformers import AutoConfig

    spec = dict(SHAPES[name])
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, dtype="bfloat16", **spec)


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's name and shape, from the model built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def random_tensor(shape: tuple[int, ...], name: str, seed: int, index: int):
    """A seeded bf16 tensor: ones for a norm's weight, else ``N(0, INIT_STD^2)`` drawn in row chunks."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, ROW_CHUNK // int(math.prod(shape[1:])))
    for start in range(0, shape[0], rows):
        block = torch.randn((min(rows, shape[0] - start), *shape[1:]), generator=generator)
        out[start : start + rows] = (block * INIT_STD).to(torch.bfloat16)
    return out


def build_checkpoint(name: str, folder: Path, seed: int = 0) -> int:
    """Write shape ``name`` with seeded random bf16 weights into ``folder`` (``save_pretrained`` layout,
    sharded safetensors with an index); at most one shard's tensors are in memory. Returns its bytes."""
    from safetensors.torch import save_file

    config = shape_config(name)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    shapes = tensor_shapes(config)
    weight_map, shard, shard_bytes, total, files = {}, {}, 0, 0, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            files.append(file)
            weight_map.update({key: file for key in shard})
            shard, shard_bytes = {}, 0

    for index, (key, shape) in enumerate(sorted(shapes.items())):
        size = 2 * math.prod(shape)
        if shard_bytes and shard_bytes + size > SHARD_BYTES:
            flush()
        shard[key] = random_tensor(shape, key, seed, index)
        shard_bytes += size
        total += size
    flush()
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1))
    return total


# ---------------------------------------------------------------- one rung in a fresh process


def peak_rss_bytes() -> int:
    """The process's peak resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, every thread counted."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def stage(args) -> dict:
    """Run one rung after loading the build; report times, peak RSS and counted FLOPs as JSON."""
    from pytest_circuits.run.plan import screen_variant
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.plan import exact_flops, probe_flops, rung1_flops, screened_flops
    from pytest_circuits.settings import CircuitsSettings, RepeatSettings

    probe = RepeatSettings(n=args.probe_n, L=args.probe_length)
    settings = CircuitsSettings(
        model=str(args.folder),
        builds=(args.build,),
        reference=args.build,
        device="cpu",
        probe=probe,
        knockout_screen=args.screen,
        knockout_screen_method=args.screen_method or "auto",
    )
    if args.rung in ("scan", "gate", "gate-key"):  # the whole command, its own load included: no second build
        return command_stage(args)
    session = Run(settings)
    wall, cpu = time.perf_counter(), cpu_seconds()
    build = session.loaded.build(args.build)
    out: dict = {"load_wall": time.perf_counter() - wall, "load_cpu": cpu_seconds() - cpu}
    out["load_rss"] = peak_rss_bytes()
    wall, cpu = time.perf_counter(), cpu_seconds()
    flops, dtype = 0.0, str(build.model.dtype).removeprefix("torch.")
    if args.rung == "rung1":
        session.measured.ov_spectrum(args.build)
        flops, dtype = rung1_flops(build.geometry, settings.kappa_method.n_rotations), "float32"
    elif args.rung == "probe":
        session.measured.repeat_probe(args.build)
        flops = probe_flops(build, probe)
    elif args.rung == "screen":  # rung 2 as the gate plans it: the screen, then its top K exactly
        frame = session.measured.head_knockout(args.build)
        top_k, probe_2 = session.measured.screen_top_k(), settings.knockout_probe
        if top_k is None:  # 300 heads or fewer: every head exactly
            flops, method, exact = exact_flops(build, probe_2), "exact", "every head"
        else:
            exact, method = frame.attrs["exact_heads"], session.measured.screen_method(args.build)
            flops = screened_flops(build, probe_2, top_k, (), method, screen_variant(settings))
        out.update(exact_heads=exact, method=method)
    out.update(wall=time.perf_counter() - wall, cpu=cpu_seconds() - cpu, rss=peak_rss_bytes(), flops=flops, dtype=dtype)
    return out


def command_stage(args) -> dict:
    """``circuits scan`` (writing its record beside the checkpoint) or ``circuits gate`` of the build
    against that record, in this fresh process that loads the build itself (the peak is the command's)."""
    from pytest_circuits.cli import main

    record = args.folder / "scan-record.json"
    if args.rung == "gate-key":
        record = key_heads_record(record, args.key_heads, args.seed, args.confirmed)
    if args.rung in ("gate", "gate-key"):  # the probe's settings are the record's
        words = ["gate", str(args.folder), "--baseline", str(record)]
        if args.change_screen is not None:
            words += ["--tol", f"change_screen={args.change_screen}"]
    else:
        words = ["scan", str(args.folder), "--json", str(record), "--probe-n", str(args.probe_n)]
        words += ["--probe-length", str(args.probe_length)]
    words += ["--build", args.build, "--device", "cpu"]
    if args.screen is not None:
        words += ["--knockout-screen", str(args.screen)]
    if args.screen_method is not None:
        words += ["--knockout-screen-method", args.screen_method]
    wall, cpu = time.perf_counter(), cpu_seconds()
    code = main(words)
    return {
        **({"key_heads": args.key_heads} if args.rung == "gate-key" else {}),
        **(
            {"change_screen": args.change_screen, "confirmed": args.confirmed}
            if args.rung == "gate-key" and args.change_screen is not None
            else {}
        ),
        "exit": code,
        "wall": time.perf_counter() - wall,
        "cpu": cpu_seconds() - cpu,
        "rss": peak_rss_bytes(),
        "flops": 0.0,
    }


def key_heads_record(record: Path, count: int, seed: int, confirmed: int = 0) -> Path:
    """``record`` with ``count`` heads, chosen at random (``seed``), made key heads: each takes the look-1
    knockout deltas (per sequence) of one of SmolLM2-135M's fp32 baseline's key heads, in turn, and its
    mean and interval; the record's further looks are dropped (the synthetic heads have none). Written
    beside it as ``scan-record-key-heads.json``, marked in its name: the figures are SmolLM2's, not this
    model's, so the gate's verdict on them means nothing; its time is what a trained model's key heads cost.
    ``confirmed``: that many of them (at random) get a ``knockout_atp`` 1000 nats from the record's,
    which no change screen clears."""
    import random

    from pytest_circuits.gate.builtin_invariants import key_heads
    from pytest_circuits.gate.stats import mean_interval
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.store import read_record, shipped_baselines

    trained = read_record(shipped_baselines()["smollm2-135m--fp32"])
    tol = Tolerances()
    rows = {r.head: r for r in trained.heads}
    donors = [rows[h].knockout_delta_sequences for h in key_heads(trained, "knockout_delta", 0, tol.min_delta)]
    donors = [v for v in donors if v and sum(v) / len(v) >= tol.min_delta]  # key on look 1 alone too
    data = json.loads(record.read_text())
    if data["knockout"]["n"] != len(donors[0]):
        raise SystemExit(f"the record's knockout n is {data['knockout']['n']}, SmolLM2's {len(donors[0])}")
    chosen = random.Random(seed).sample(range(len(data["heads"])), min(count, len(data["heads"])))
    for i, index in enumerate(sorted(chosen)):
        values = donors[i % len(donors)]
        row = data["heads"][index]
        row["knockout_delta"] = sum(values) / len(values)
        row["knockout_delta_sequences"] = list(values)
        row["knockout_delta_interval"] = list(mean_interval(values) or (None, None))
    for index in random.Random(seed + 1).sample(sorted(chosen), min(confirmed, len(chosen))):
        row = data["heads"][index]
        if row.get("knockout_atp") is None:
            raise SystemExit("the record holds no knockout_atp (recorded before it was stored): record it again")
        row["knockout_atp"] += 1000.0
    data["looks"] = None
    out = record.with_name("scan-record-key-heads.json")
    out.write_text(json.dumps(data))
    return out


def run_stage(shape: str, folder: Path, rung: str, options) -> dict:
    """`stage` in a fresh interpreter (its peak RSS is its own); the JSON it prints last, with the
    plan's lines it said (``circuits: ... took ...``)."""
    command = [sys.executable, __file__, "--stage", rung, "--folder", str(folder), "--build", options.build]
    command += ["--probe-n", str(options.probe_n), "--probe-length", str(options.probe_length)]
    command += ["--key-heads", str(options.key_heads), "--seed", str(options.seed)]
    if options.change_screen is not None:
        command += ["--change-screen", str(options.change_screen), "--confirmed", str(options.confirmed)]
    if options.screen is not None:
        command += ["--screen", str(options.screen)]
    if options.screen_method is not None:
        command += ["--screen-method", options.screen_method]
    print(f"[{time.strftime('%H:%M:%S')}] {shape}: {rung}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, env=env)  # this checkout's package
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode}: {' | '.join(tail)}"}
    said = [line for line in (done.stderr + done.stdout).splitlines() if line.startswith("circuits: ")]
    return {**json.loads(lines[-1]), "said": said}


def matmul_ceiling(size: int = 4096, repeats: int = 3) -> dict[str, float]:
    """This CPU's matmul rate (FLOP/s) in float32 and bfloat16 at torch's thread count: one
    ``size x size`` by ``size x size`` ``torch.matmul``, timed after a warm-up (the ceiling of every rung)."""
    import torch

    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        torch.matmul(a, b)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a, b)
        rates[str(dtype).removeprefix("torch.")] = 2 * size**3 * repeats / (time.perf_counter() - start)
    return rates


def machine_load() -> str:
    """The 1-minute load average over the cores, as the rows are measured."""
    return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


# ---------------------------------------------------------------- the table


def probe_words(options) -> str:
    """The probe and rung-2 plan a row was measured with."""
    screen = "the default plan" if options.screen is None else f"top {options.screen}"
    return f"n {options.probe_n}, L {options.probe_length}; {options.screen_method or 'auto'} + {screen}"


def plan_ratio(result: dict) -> str:
    """The plan's estimate beside the wall time, from the ``took`` lines a command said (the whole scan's)."""
    took = [line for line in result.get("said", []) if " took " in line]
    scan = [line for line in took if "the scan took" in line] or took
    return scan[-1].split("the plan estimated ", 1)[1] if scan else ""


def table(rows: list[dict], options) -> str:
    """The measured table in Markdown: a shape's weights, memory goal and plan on its first row."""
    head = (
        "| shape (weights; goal: weights x 1.25 + 1.5 GB) | rung | peak RSS | CPU s | wall s | counted | achieved | "
        "of the ceiling | plan's estimate |\n|---|---|---|---|---|---|---|---|---|"
    )
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    lines = [head]
    for row in rows:
        weights = row["weights_bytes"]
        goal = 1.25 * weights + 1.5e9
        ceiling = row.get("ceiling", {})
        shape = f"{row['shape']} ({weights / 1e9:.2f} GB; {goal / 1e9:.2f} GB; {row.get('probe', '')})"
        for rung in row["rungs"]:
            result = row["rungs"][rung]
            label = {"load": "load + self-check"}.get(rung, rung)
            if rung == "gate-key":
                label = f"gate, {result.get('key_heads')} key heads (random, SmolLM2's deltas)"
                if result.get("change_screen") is not None:
                    label += f", change screen {result['change_screen']:g}: {result['confirmed']} knocked out"
            if result.get("probe", row.get("probe")) != row.get("probe"):  # a rung run under another plan
                label += f" ({result['probe']})"
            if "error" in result:
                why = result["error"].split(":")[0]  # "exit N": the process's own lines are in its log
                lines.append(f"| {shape} | {label} | not completed ({why}) | | | | | | |")
                shape = ""
                continue
            rss = result["rss"]
            mark = "" if rss <= goal else " (over the goal)"
            wall, cpu = (result["load_wall"], result["load_cpu"]) if rung == "load" else (result["wall"], result["cpu"])
            flops = result.get("flops") or 0.0
            rate = f"{flops / wall / 1e9:,.0f} GFLOP/s" if flops and wall > 0 else ""
            shown_flops = f"{flops / 1e12:.2f} TFLOP" if flops else ""
            dtype = result.get("dtype", "")
            top = ceiling.get(dtype)
            fraction = ""
            if flops and wall > 0 and top:
                fraction = f"{flops / wall / top:.0%} of {short.get(dtype, dtype)}'s {top / 1e9:,.0f}"
            lines.append(
                f"| {shape} | {label} | {rss / 1e9:.2f} GB{mark} | {cpu:.0f} | {wall:.0f} | {shown_flops} | {rate} | "
                f"{fraction} | {plan_ratio(result)} |"
            )
            shape = ""
    return "\n".join(lines)


def gathered_rows(path: Path) -> list[dict]:
    """The rows of a ``--results`` file, one per shape (in `SHAPES` order), each rung's latest run that did not fail."""
    by_shape: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        kept = by_shape.setdefault(row["shape"], {**row, "rungs": {}})
        for rung, result in row["rungs"].items():
            if "error" not in result or rung not in kept["rungs"]:
                # the plan it ran under and the load as it started
                kept["rungs"][rung] = {**result, "probe": row.get("probe", ""), "machine_load": row.get("machine_load")}
    order = {rung: i for i, rung in enumerate(RUNGS)}
    for row in by_shape.values():
        row["rungs"] = dict(sorted(row["rungs"].items(), key=lambda item: order[item[0]]))
    return [by_shape[name] for name in SHAPES if name in by_shape]


def rung_loads(row: dict) -> str:
    """The load each rung of a gathered row started at, ``load 1.2 on 2 cores (rung), ...``; that one
    load where every rung started at the same."""
    loads = {rung: result.get("machine_load") or row["machine_load"] for rung, result in row["rungs"].items()}
    if len(set(loads.values())) <= 1:
        return next(iter(loads.values()), row["machine_load"])
    return ", ".join(f"{load} ({rung})" for rung, load in loads.items())


def write_docs(text: str, note: str, block: str = "sizes") -> None:
    """Replace a measured block of docs/scale.md (between its markers: ``sizes``, or ``stacks`` for
    `STACK_SHAPES`) with ``text``."""
    begin, end_mark = (STACK_BEGIN, STACK_END) if block == "stacks" else (BEGIN, END)
    write_block(begin, end_mark, note, text)


def write_block(begin: str, end_mark: str, note: str, text: str) -> None:
    """Replace what docs/scale.md holds between the markers ``begin`` and ``end_mark`` (its first after
    ``begin``) with ``note`` and ``text`` (`measure_gate_speed.py` writes its block here too)."""
    page = DOCS.read_text()
    start = page.index(begin)
    end = page.index(end_mark, start)
    DOCS.write_text(page[: start + len(begin)] + "\n\n" + note + "\n\n" + text + "\n\n" + page[end:])


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`main`'s options; the benchmark reuses them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-3.2-1b", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--rungs", default=",".join(RUNGS), help="comma list of " + ", ".join(RUNGS))
    parser.add_argument(
        "--folder", type=Path, default=Path(os.environ.get("CIRCUITS_SIZES_DIR", "/work/scratch/sizes"))
    )
    parser.add_argument("--build", default="bf16")
    parser.add_argument("--probe-n", type=int, default=8)
    parser.add_argument("--probe-length", type=int, default=64)
    parser.add_argument(
        "--screen", type=int, default=None, help="exact knockouts after the screen (default: the plan's 12)"
    )
    parser.add_argument(
        "--screen-method", default=None, help="the screen's method (default: the plan's, auto: docs/scale.md)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--key-heads", type=int, default=300, help="the gate-key rung's key heads (key_heads_record)")
    parser.add_argument(
        "--change-screen", type=float, default=None, help="the gate-key rung's --tol change_screen (off: exact)"
    )
    parser.add_argument(
        "--confirmed", type=int, default=0, help="with --change-screen: key heads the screen must knock out"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/scale.md")
    parser.add_argument("--results", type=Path, default=None, help="append each shape's JSON here")
    parser.add_argument("--table-only", action="store_true", help="run nothing: the table of --results only")
    parser.add_argument(
        "--block", choices=("sizes", "stacks"), default="sizes", help="which measured block of docs/scale.md to write"
    )
    parser.add_argument("--stage", choices=RUNGS, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_options(argv)
    if args.stage is not None:
        args.rung = args.stage
        print(json.dumps(stage(args)), flush=True)
        return 0
    rows = []
    for shape in [] if args.table_only else args.shapes.split(","):
        if shape not in SHAPES:
            print(f"measure_sizes: unknown shape {shape!r}; use one of {', '.join(SHAPES)}", file=sys.stderr)
            return 2
        folder = args.folder / shape
        if not (folder / "model.safetensors.index.json").exists():
            print(f"[{time.strftime('%H:%M:%S')}] {shape}: building into {folder}", file=sys.stderr, flush=True)
            build_checkpoint(shape, folder, args.seed)
        weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        row = {"shape": shape, "weights_bytes": weights, "probe": probe_words(args), "rungs": {}}
        row.update(ceiling=matmul_ceiling(), machine_load=machine_load())  # before the rungs, on the same threads
        for rung in args.rungs.split(","):
            row["rungs"][rung] = run_stage(shape, folder, rung, args)
            print(json.dumps({shape: {rung: row["rungs"][rung]}}), file=sys.stderr, flush=True)
        rows.append(row)
        if args.results is not None:
            with open(args.results, "a") as handle:
                handle.write(json.dumps(row) + "\n")
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    if args.results is not None:  # every shape measured into this file so far, each rung's latest run
        rows = gathered_rows(args.results)
    text = table(rows, args)
    print(text)
    if args.write_docs:
        plan = "".join(
            f" --{name} {value}"
            for name, value in (("screen", args.screen), ("screen-method", args.screen_method))
            if value is not None
        )
        loads = "; ".join(f"{row['shape']}: {rung_loads(row)}" for row in rows if "machine_load" in row)
        note = (
            f"`python scripts/measure_sizes.py --shapes {args.shapes} --probe-n {args.probe_n} "
            f"--probe-length {args.probe_length}{plan} --write-docs` ({time.strftime('%Y-%m-%d')}; "
            f"the 1-minute load as each shape started: {loads or 'not recorded'}):"
        )
        if args.table_only:
            note = (
                f"Gathered from the runs `python scripts/measure_sizes.py --shapes SHAPE --rungs RUNGS{plan} --results "
                f"{args.results.name}` made so far, each rung in its own process ({time.strftime('%Y-%m-%d')}; "
                f"the 1-minute load as each shape started: {loads or 'not recorded'}); a rung not in the table was not run:"
            )
        write_docs(text, note, args.block)
    return 0


if __name__ == "__main__":
    sys.exit(main())

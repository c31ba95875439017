"""Float8 linear layers (model.converters, trainer/float8.py) train the same in every layout.

Four steps of the tiny Llama in float32 weights, deterministic, from the same initial weights on
the same batches. The references are one process: float8 and high precision, at the global batch
of each layout (8 sequences for the data-parallel layouts, 16 under accumulation, 4 for TP, PP and
CP), in the same compute precision.

Float8 scales each matmul operand by its own absolute maximum (dynamic scaling), so a layout that
splits an operand differently rounds it differently: a data-parallel rank scales its own 4
sequences, a pipeline stage each microbatch, where the one process scales all 8 at once. A
layout is therefore compared with the one-process float8 run to what float8's rounding moves:
at most twice what float8 itself changes against high precision in one process, measured here
at the same steps (1.2e-4 to 2.5e-4 in loss and 3e-5 to 7e-5 in relative gradient norm over four
steps; the layouts measured 1e-6 to 2.3e-4). Computing in bfloat16 or float16, every op of a
layout also rounds where one process's does not: those runs are held to two units of the
format's roundoff (relative), as the compile matrix holds its low-precision runs. A gradient that
is not reduced, or averaged twice, moves the gradient norm by 1e-2 or more; a position bug in one
context-parallel chunk stays under float8's rounding here and is the float32 parity tests' to
catch (the same code with float8 off). Layouts that split no operand are bitwise equal
to each other: FSDP with and without float8 all-gather (its float8 weight shards carry the whole
weight's scale), with activation checkpointing, compiled with aot_eager, and DDP. Under float16
compute, float8 all-gather with scales precomputed after every update (loss scaling's path) is
held to float16's roundoff; compiled by inductor, with its memory budget, a run to float8's
rounding, as the other layouts. Each float8
run also differs from high precision by more than fp32 rounding (1e-5 or more), so a layout that
silently trained without float8 fails.

Tensor parallelism casts a block's input to float8 before its all-gather (torchao's float8
styles), scaled by the whole sequence's maximum as one process scales it: its matmuls take the same
float8 operands, and only the row-wise layers' sums are added in another order (1e-6 in loss,
measured). Under FSDP with float8 all-gather (4 processes) it is held to float8's rounding, as FSDP.

Every pipeline schedule runs the microbatches of Interleaved1F1B: the same losses, bitwise.

A checkpoint of a run with float8 all-gather (whose weights torchao wraps) resumes onto the same
curve bitwise, holds plain float32 tensors (no torchao class in its files), and is resumed with
float8 off, which the run names as a changed setting.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from tests.launch import TINY_JOB, run_many
from trainer.float8 import cpu_has_amx
from trainer.models.llama3.args import get_flavor
from trainer.models.llama3.hf_config import hf_config

pytestmark = pytest.mark.cores(2)

STEPS = 4
BASE = [*TINY_JOB, "--training.steps", str(STEPS), "--training.local_batch_size", "4", "--checkpoint.no_enable"]
FLOAT8 = ["--model.converters", "float8"]
OPTION = "--quantize.linear.float8."
ALL_GATHER = [OPTION + "enable_fsdp_float8_all_gather", OPTION + "precompute_float8_dynamic_scale_for_fsdp"]
GLOBAL_8 = ["--training.local_batch_size", "8"]

# Compute precisions other than float32, each with its one-process references.
PRECISIONS = {"bfloat16 compute": ["--training.mixed_precision_param", "bfloat16"],
              "float16 compute": ["--training.mixed_precision_param", "float16"],
              "full bfloat16": ["--training.dtype", "bfloat16"]}
# One process: name -> overrides.
REFERENCES = {
    "one float8, batch 8": [*FLOAT8, *GLOBAL_8],
    "one high precision, batch 8": GLOBAL_8,
    "one float8 rowwise, batch 8": [*FLOAT8, *GLOBAL_8, OPTION + "recipe_name", "rowwise"],
    "one float8, batch 4": FLOAT8,
    "one high precision, batch 4": [],
    "one float8, batch 16": [*FLOAT8, "--training.local_batch_size", "16"],
    "one high precision, batch 16": ["--training.local_batch_size", "16"],
    **{f"one float8 {name}, batch 8": [*FLOAT8, *GLOBAL_8, *overrides] for name, overrides in PRECISIONS.items()},
    **{f"one high precision {name}, batch 8": [*GLOBAL_8, *overrides] for name, overrides in PRECISIONS.items()},
}
# Two processes: name -> (overrides, its one-process float8 reference, high-precision reference).
LAYOUTS = {
    "FSDP": (FLOAT8, "one float8, batch 8", "one high precision, batch 8"),
    "FSDP, float8 all-gather": ([*FLOAT8, *ALL_GATHER], "one float8, batch 8", "one high precision, batch 8"),
    "FSDP, AC full": ([*FLOAT8, "--activation_checkpoint.mode", "full"], "one float8, batch 8",
                      "one high precision, batch 8"),
    "FSDP, AC selective op": ([*FLOAT8, "--activation_checkpoint.mode", "selective",
                               "--activation_checkpoint.selective_ac_option", "op"], "one float8, batch 8",
                              "one high precision, batch 8"),
    "FSDP, AC selective layer": ([*FLOAT8, "--activation_checkpoint.mode", "selective"], "one float8, batch 8",
                                 "one high precision, batch 8"),
    "FSDP, compiled": ([*FLOAT8, "--compile.enable", "--compile.backend", "aot_eager"], "one float8, batch 8",
                       "one high precision, batch 8"),
    # Inductor's generated kernels (compile.backend's default), with the recomputation its memory
    # budget chooses: the scales computed in fused float32 kernels round a little otherwise, so
    # this run is not bitwise FSDP's (4.8e-7 in loss, 1.0e-6 in gradient norm, measured).
    "FSDP, inductor, AC memory_budget": ([*FLOAT8, "--compile.enable", "--activation_checkpoint.mode", "memory_budget",
                                         "--activation_checkpoint.memory_budget", "0.5"], "one float8, batch 8",
                                        "one high precision, batch 8"),
    "DDP": ([*FLOAT8, "--parallelism.data_parallel_replicate_degree", "2",
             "--parallelism.data_parallel_shard_degree", "1"], "one float8, batch 8", "one high precision, batch 8"),
    "FSDP, rowwise": ([*FLOAT8, OPTION + "recipe_name", "rowwise"], "one float8 rowwise, batch 8",
                      "one high precision, batch 8"),
    "TP": ([*FLOAT8, "--parallelism.tensor_parallel_degree", "2"], "one float8, batch 4",
           "one high precision, batch 4"),
    "PP Interleaved1F1B": ([*FLOAT8, "--parallelism.pipeline_parallel_degree", "2",
                            "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
                           "one float8, batch 4", "one high precision, batch 4"),
    "CP": ([*FLOAT8, "--parallelism.context_parallel_degree", "2"], "one float8, batch 4",
           "one high precision, batch 4"),
    # 2 local batches of 4 per step on each of 2 ranks.
    "FSDP, accumulation": ([*FLOAT8, "--training.global_batch_size", "16"], "one float8, batch 16",
                           "one high precision, batch 16"),
    **{f"FSDP, {name}": ([*FLOAT8, *overrides], f"one float8 {name}, batch 8", f"one high precision {name}, batch 8")
       for name, overrides in PRECISIONS.items()},
    # Float8 all-gather with precomputed scales on float16's loss-scaled update path: its float8
    # shards are cast from the float32 weights, not from FSDP's float16 copy, so the numbers move
    # by float16's rounding, not bitwise.
    "FSDP, float16 compute, float8 all-gather": ([*FLOAT8, *ALL_GATHER, *PRECISIONS["float16 compute"]],
                                                 "one float8 float16 compute, batch 8",
                                                 "one high precision float16 compute, batch 8"),
}
# Below float32 every op of a layout rounds where one process's does not (its sums in another
# order), float8 or not: those layouts are held to two units of the compute format's roundoff
# (relative), as the compile matrix holds its low-precision runs. The float32 layouts hold the
# parity to what float8 itself moves.
ROUNDOFF = {"bfloat16 compute": 2 ** -8, "float16 compute": 2 ** -11, "full bfloat16": 2 ** -8}
# Every other pipeline schedule, on the microbatches Interleaved1F1B runs.
SCHEDULES = ("GPipe", "1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Four processes: HSDP, 2 replicas of 2 shards, 2 sequences each.
LAYOUTS_4 = {"HSDP": ([*FLOAT8, "--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
                      "one float8, batch 8", "one high precision, batch 8"),
             # torchao's float8 styles under FSDP's float8 all-gather: 2 data-parallel ranks of 4 sequences.
             "FSDP 2 x TP 2, float8 all-gather": ([*FLOAT8, *ALL_GATHER, "--parallelism.tensor_parallel_degree", "2"],
                                                 "one float8, batch 8", "one high precision, batch 8")}
# Tensor parallelism gathers float8 layers' inputs in float8 (trainer/parallel/float8_tp.py).
FLOAT8_GATHERS = ("TP", "FSDP 2 x TP 2, float8 all-gather")
# Bitwise equal to FSDP's float8 run: they split no matmul operand differently.
SAME_AS_FSDP = ("FSDP, float8 all-gather", "FSDP, AC full", "FSDP, AC selective op", "FSDP, AC selective layer",
                "FSDP, compiled", "DDP")


TIED = "FSDP, tied embeddings"


def tied_runs(folder) -> tuple[dict, dict]:
    """The tiny model with its output layer tied to the embedding (a config.json in `folder`):
    (one-process references, the FSDP layout)."""
    (folder / "config.json").write_text(json.dumps(hf_config(replace(get_flavor("tiny"), tie_embeddings=True))))
    tied = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder)]
    references = {"one float8 tied, batch 8": [*tied, *FLOAT8, *GLOBAL_8], "one high precision tied, batch 8": [*tied, *GLOBAL_8]}
    return references, {TIED: ([*tied, *FLOAT8], *references)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    one, two, four = (tmp_path_factory.mktemp(f"float8-{n}") for n in ("one", "two", "four"))
    tied_references, tied_layout = tied_runs(tmp_path_factory.mktemp("float8-tied"))
    saved = two / "saved"
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "2", "--job.dump_folder", str(saved)]
    runs = {name: overrides for name, (overrides, _, _) in {**LAYOUTS, **tied_layout}.items()}
    pipeline = LAYOUTS["PP Interleaved1F1B"][0]
    runs.update({f"PP {schedule}": [*pipeline, "--parallelism.pipeline_parallel_schedule", schedule]
                 for schedule in SCHEDULES})
    # A run with float8 all-gather saved at step 2, resumed to step 4, then resumed with float8 off.
    runs["saved at step 2"] = [*FLOAT8, *ALL_GATHER, *checkpoint, "--training.steps", "2"]
    runs["resumed"] = [*FLOAT8, *ALL_GATHER, *checkpoint]
    runs["resumed without float8"] = [*checkpoint, "--training.steps", "6"]
    with ThreadPoolExecutor(3) as pool:  # the three process groups side by side
        groups = [pool.submit(run_many, 1, BASE, {**REFERENCES, **tied_references}, one), pool.submit(run_many, 2, BASE, runs, two),
                  pool.submit(run_many, 4, BASE, {name: overrides for name, (overrides, _, _) in LAYOUTS_4.items()}, four)]
        found = {name: run for group in groups for name, run in group.result()[0].items()}
    return {**found, "saved": saved, "layouts": {**LAYOUTS, **tied_layout, **LAYOUTS_4}}


def curve(run: dict) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in run["metrics"] if "kind" not in r]


def gaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> tuple[float, float]:
    """(max |loss difference|, max relative gradient-norm difference) over the steps."""
    assert len(a) == len(b) == STEPS
    return (max(abs(x[0] - y[0]) for x, y in zip(a, b)), max(abs(x[1] - y[1]) / y[1] for x, y in zip(a, b)))


@pytest.mark.parametrize("layout", [*LAYOUTS, TIED, *LAYOUTS_4])
def test_a_float8_layout_trains_like_one_process_to_float8s_rounding(layout, results, measured):
    _, reference, high_precision = results["layouts"][layout]
    run = curve(results[layout])
    float8_effect = gaps(curve(results[reference]), curve(results[high_precision]))
    layout_gap = gaps(run, curve(results[reference]))
    precision = next((name for name in ROUNDOFF if layout.startswith(f"FSDP, {name}")), None)
    if precision is not None:
        roundoff = ROUNDOFF[precision]
        loss = curve(results[reference])[0][0]
        layout_gap = (layout_gap[0] / loss, layout_gap[1])  # relative, as the roundoff is
        allowed = (roundoff, roundoff)
    else:
        allowed = float8_effect
    measured(f"float8 {layout:24s} vs one process: |dloss| {layout_gap[0]:.1e}, grad-norm {layout_gap[1]:.1e} (allowed "
             f"2 x {allowed[0]:.1e}, {allowed[1]:.1e}); float8 vs high precision in one process: {float8_effect[0]:.1e}, "
             f"{float8_effect[1]:.1e}")
    assert "float8: 28 linear layers in float8" in results[layout]["log"]
    # On a CPU with AMX, oneDNN's reference float8 matmul is kept out (trainer/float8.py).
    assert ("float8 on a CPU with AMX: oneDNN off" in results[layout]["log"]) == cpu_has_amx()
    assert ("float8 layers' inputs gathered in float8" in results[layout]["log"]) == (layout in FLOAT8_GATHERS)
    # Float8 is on: this run is further from high precision than fp32 rounding moves a layout.
    assert gaps(run, curve(results[high_precision]))[0] >= 1e-5
    assert layout_gap[0] <= 2 * allowed[0] and layout_gap[1] <= 2 * allowed[1]


@pytest.mark.parametrize("layout", SAME_AS_FSDP)
def test_layouts_that_split_no_operand_are_bitwise_equal(layout, results):
    fsdp, run = curve(results["FSDP"]), curve(results[layout])
    assert [loss for loss, _ in run] == [loss for loss, _ in fsdp]
    assert gaps(run, fsdp)[1] <= 1e-12  # DDP sums its norm from replicated gradients: the last bits may differ


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_pipeline_schedule_trains_as_interleaved_1f1b(schedule, results):
    """The same microbatches: the same losses; the gradients summed over them in another order
    (float32 rounding)."""
    interleaved, run = curve(results["PP Interleaved1F1B"]), curve(results[f"PP {schedule}"])
    assert [loss for loss, _ in run] == [loss for loss, _ in interleaved]
    assert gaps(run, interleaved)[1] <= 1.2e-7


def test_a_float8_checkpoint_resumes_bitwise_holds_plain_weights_and_loads_without_float8(results):
    assert curve(results["saved at step 2"]) + curve(results["resumed"])[2:] == curve(results["FSDP, float8 all-gather"])
    for shard in (results["saved"] / "checkpoint" / "step-2").glob("*.distcp"):
        assert b"torchao" not in shard.read_bytes()  # plain tensors: no torchao class to unpickle
    off = results["resumed without float8"]
    assert [r["step"] for r in off["metrics"] if "kind" not in r] == list(range(1, 7))  # one trajectory
    assert "model.converters ['float8'] -> []" in off["log"] and "float8: " not in off["log"]

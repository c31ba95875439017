"""torch.compile changes no number, in every combination a user can configure.

Each combination is compiled and compared with the same layout run eagerly (activation
checkpointing off): three steps of the tiny Llama in fp32 with deterministic algorithms, from the
same initial weights (init is layout-invariant) on the same batches. Compiled and eager must agree
within 1e-6 (loss, absolute) and 1e-6 (gradient norm, relative) at every step: what fp32 rounding
of a fused kernel moves, and 1,000 times less than the bugs below. The eager layouts themselves are
compared with the 1D FSDP control by tests/integration/test_parallel_parity.py.

The matrix: {FSDP, TP, PP, CP, reduced-sync TP} x activation checkpointing {none, selective op,
selective layer, full} (and inductor's memory budget under FSDP and TP) on 2 processes, with TP
with loss parallelism off under AC none, and FSDP x TP x PP under AC none and full on 8; and tied
embeddings (TP, PP), document masking (FSDP, TP, CP), validation (TP, its losses compared too),
gradient accumulation, DDP, a warm compile cache, float16 (loss scaling) and full bfloat16
(training.dtype), the last two compared to their formats' precision. The 2-process runs share one
process group and the 8-process runs another (tests/workers/run_many.py), so the matrix pays the
start of torch twice; the two groups run side by side (alone on 2 cores: 184-189 s, against
204-206 s one after the other).

Two layouts run fewer modes, as the others would compile no graph the matrix does not already:
- TP with loss parallelism off: AC none. The option changes the output projection and the loss
  (all-gathered logits, an AsyncCollectiveTensor resolved before the compiled loss), outside the
  blocks the AC modes recompute; its blocks are TP's, compiled under every mode in the TP row.
  Under the memory budget its compiled loss takes plain tensors, as FSDP's does (FSDP, memory
  budget).
- FSDP x TP x PP: AC none and full. What only this layout has, FSDP sharding over 2 ranks beside
  TP inside pipeline stages, stays outside the compiled graphs (FSDP gathers around each block).
  Selective layer is full recomputation on some blocks and none on the others; the op-level
  policy inside compiled TP blocks and inside pipeline stages is checked by the TP, reduced-sync
  TP and PP rows.

Backends: inductor (the default, generated kernels) where the layout changes what the graph
computes: FSDP, TP with and without loss parallelism (also with the memory budget, inductor's
own), tied TP, document masking and validation under TP, bfloat16, the warm cache. aot_eager
(AOTAutograd's tracing, then torch's kernels: bitwise equal to eager) where the layout changes
how graphs are cut and composed: PP, CP, reduced-sync TP, FSDP x TP x PP, and the options that
add no new graph (DDP, accumulation, float16's loss scaling). Generating kernels for every
combination would cost minutes of the suite on 2 cores.

What it catches (each found on torch 2.13, fixed in trainer/parallel/compile.py):
- the embedding's AsyncCollectiveTensor handed to the first compiled TP block: a step-1 gradient
  norm 1.7e-3 (relative) off, or a crash in backward;
- a second run from a warm compile cache under TP: every rank loaded the loss-parallel graph one
  rank had written, loss 5.69 instead of 6.07 at step 1 ("TP, warm compile cache");
- full recomputation inside a compiled TP block: a crash in the compiled forward;
- a memory budget between 0 and 1 under TP: a crash while compiling.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from tests.launch import run_many
from tests.unit.test_tokenizer import sentences
from trainer.data.tokenizer import train_tokenizer
from trainer.models.llama3.args import get_flavor
from trainer.models.llama3.hf_config import hf_config

# The compile matrix keeps both cores busy (compiling ranks): tests/machine_share.py.
pytestmark = pytest.mark.cores(2)

STEPS = 3
BASE = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", str(STEPS),
        "--training.local_batch_size", "4", "--optimizer.lr", "3e-3", "--optimizer.weight_decay", "0",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.no_enable_tensorboard",
        "--debug.deterministic", "--checkpoint.no_enable"]
LOSS_ATOL, NORM_RTOL = 1e-6, 1e-6

AC = {
    "AC none": ["--activation_checkpoint.mode", "none"],
    "AC selective op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "AC selective layer": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    "AC full": ["--activation_checkpoint.mode", "full"],
}
# The compiler's own choice (inductor's partitioner only), at the default budget: between 0 and 1
# the partitioner weighs what to keep (under TP torch 2.13 stopped there before set_memory_budget).
MEMORY_BUDGET = {"AC memory_budget 0.5": ["--activation_checkpoint.mode", "memory_budget",
                                         "--activation_checkpoint.memory_budget", "0.5"]}
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
# name -> (overrides, backend, recomputation modes). inductor where its generated code meets what
# the layout changes in the graph (sharded matmuls, the vocabulary-parallel loss, the gathered
# logits); aot_eager, which traces and partitions as inductor does but runs torch's kernels, where
# the layout changes how graphs are cut and composed (pipeline stages, CP's ring attention op, the
# reduced-sync residual stream). The memory budget is inductor's partitioner only.
EVERY_AC, AC_AND_BUDGET = tuple(AC), (*AC, *MEMORY_BUDGET)
LAYOUTS_2 = {
    "FSDP": ([], "inductor", AC_AND_BUDGET),
    "TP": (TP2, "inductor", AC_AND_BUDGET),
    # Its blocks are TP's (see the module docstring): the option's own graphs under AC none.
    "TP, loss parallel off": ([*TP2, "--parallelism.disable_loss_parallel"], "inductor", ("AC none",)),
    "PP": (PP2, "aot_eager", EVERY_AC),
    "CP": (["--parallelism.context_parallel_degree", "2"], "aot_eager", EVERY_AC),
    "TP reduced-sync": ([*TP2, "--parallelism.tensor_parallel_sync", "per_block"], "aot_eager", EVERY_AC),
}
# Without recomputation and with full recomputation (see the module docstring).
LAYOUTS_8 = {"FSDP x TP x PP": ([*TP2, *PP2, "--parallelism.pipeline_parallel_microbatch_size", "2"], "aot_eager",
                                ("AC none", "AC full"))}


def matrix(layouts: dict[str, tuple[list[str], str, tuple[str, ...]]]) -> dict[str, tuple[str, list[str]]]:
    """compiled run name -> (its eager reference's name, its overrides), and the references."""
    runs = {}
    for layout, (overrides, backend, modes) in layouts.items():
        runs[f"{layout} eager"] = ("", [*overrides, *AC["AC none"]])
        for mode in modes:
            runs[f"{layout} compiled, {mode}"] = (f"{layout} eager", [*overrides, *{**AC, **MEMORY_BUDGET}[mode],
                                                                      "--compile.enable", "--compile.backend", backend])
    return runs


def extras(tied: str, corpus: tuple[str, str, str]) -> dict[str, tuple[str, list[str]]]:
    """Options that change what a compiled block or loss computes, each with its own reference."""
    tied_model = ["--model.flavor", "hf", "--model.hf_assets_path", tied]
    model, docs, tokenizer = corpus
    documents = ["--model.flavor", "hf", "--model.hf_assets_path", model, "--training.dataset", "files",
                 "--training.dataset_path", docs, "--model.tokenizer_path", tokenizer, "--training.document_masking"]
    # A first loss scale float16 gradients overflow at: compiled and eager must skip the same steps.
    fp16 = ["--training.mixed_precision_param", "float16", "--training.loss_scale_initial", str(2 ** 22)]
    bf16 = ["--training.dtype", "bfloat16"]
    ddp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    validation = ["--validation.enable", "--validation.freq", "1", "--validation.steps", "1",
                  "--validation.global_batch_size", "8"]
    accumulation = ["--training.global_batch_size", "16"]  # 2 local batches of 4 per step on each of 2 ranks
    # name -> (overrides, backend), as the layouts above.
    references = {"tied TP": ([*tied_model, *TP2], "inductor"), "tied PP": ([*tied_model, *PP2], "aot_eager"),
                  "validation TP": ([*validation, *TP2], "inductor"), "accumulation FSDP": (accumulation, "aot_eager"),
                  "documents FSDP": (documents, "aot_eager"), "documents TP": ([*documents, *TP2], "inductor"),
                  "documents CP": ([*documents, "--parallelism.context_parallel_degree", "2"], "aot_eager"),
                  "float16 FSDP": (fp16, "aot_eager"), "bfloat16 TP": ([*bf16, *TP2], "inductor"),
                  "DDP": (ddp, "aot_eager")}
    # float16 and bfloat16 are compared by test_compiled_low_precision_..., the others by compare().
    runs = {}
    for name, (overrides, backend) in references.items():
        runs[f"{name} eager"] = ("", overrides)
        runs[f"{name} compiled"] = (f"{name} eager", [*overrides, "--compile.enable", "--compile.backend", backend])
    runs["tied TP compiled, AC full"] = ("tied TP eager", [*references["tied TP"][0], *AC["AC full"], "--compile.enable"])
    # The first compiled TP run wrote the compile cache; this one reads it.
    runs["TP, warm compile cache"] = ("TP eager", [*TP2, *AC["AC none"], "--compile.enable"])
    return runs


def run_matrix(nproc: int, runs: dict[str, tuple[str, list[str]]], folder) -> dict:
    # The test run's compile cache (tests/conftest.py): the first compile of each graph is cold, a
    # repeated one warm, and the suite's other compiled runs of the same graphs load what the matrix
    # built. The SLURM smoke's compiled set is its "TP compiled, AC selective layer": 4 processes
    # of it took 75 CPU-seconds cold, 49 after a run of the matrix's. The ranks share the kernels
    # they generate (trainer/parallel/compile.py): one builds a kernel while the others wait for it.
    # Two compile threads per rank keep 2 builds going on the 2 ranks' 2 cores, where one thread per
    # rank builds one at a time; the 8 ranks compile nothing (aot_eager) and keep one.
    threads = "2" if nproc == 2 else "1"
    found, _ = run_many(nproc, BASE, {name: overrides for name, (_, overrides) in runs.items()}, folder,
                        env={"TORCHINDUCTOR_COMPILE_THREADS": threads})
    return found


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny model's config.json tied, and with a 512-token vocabulary beside a corpus of
    documents and its 512-token tokenizer."""
    tied, text = tmp_path_factory.mktemp("compile-tied"), tmp_path_factory.mktemp("compile-text")
    (tied / "config.json").write_text(json.dumps(hf_config(replace(get_flavor("tiny"), tie_embeddings=True))))
    (text / "config.json").write_text(json.dumps(hf_config(replace(get_flavor("tiny"), vocab_size=512))))
    with open(text / "docs.jsonl", "w") as f:
        for doc in sentences(400):
            f.write(json.dumps({"text": doc}) + "\n")
    tokenizer = train_tokenizer([str(text / "docs.jsonl")], str(text / "tok"), 512)
    return str(tied), (str(text), str(text / "docs.jsonl"), str(tokenizer))


RUNS_2 = matrix(LAYOUTS_2)
RUNS_8 = matrix(LAYOUTS_8)
EXTRA_NAMES = list(extras("", ("", "", "")))


@pytest.fixture(scope="module")
def results(assets, tmp_path_factory) -> dict:
    """name -> (the run's results, its reference's results): each process group launched once."""
    done: dict[str, tuple[dict, dict]] = {}

    def get(name: str) -> tuple[dict, dict]:
        if not done:
            groups = {2: {**RUNS_2, **extras(*assets)}, 8: RUNS_8}
            folders = {nproc: tmp_path_factory.mktemp(f"compile-{nproc}") for nproc in groups}
            # The two process groups side by side: the 8 ranks' short aot_eager runs fill the core
            # time the 2 compiling ranks leave while one waits for a kernel the other builds.
            with ThreadPoolExecutor(len(groups)) as pool:
                started = {nproc: pool.submit(run_matrix, nproc, runs, folders[nproc])
                           for nproc, runs in groups.items()}
            for nproc, runs in groups.items():
                found = started[nproc].result()
                done.update({run: (found[run], found.get(reference)) for run, (reference, _) in runs.items()})
        return done[name]

    return get


def training(metrics: list[dict]) -> list[dict]:
    return [r for r in metrics if "kind" not in r]


def compare(name: str, results, measured) -> None:
    run, reference = results(name)
    test, control = training(run["metrics"]), training(reference["metrics"])
    assert [r["step"] for r in test] == [r["step"] for r in control] == list(range(1, STEPS + 1))
    validated = [(t["validation/loss"], c["validation/loss"]) for t, c in zip(run["metrics"], reference["metrics"])
                 if t.get("kind") == "validation"]
    assert len(validated) == (STEPS if name.startswith("validation") else 0)
    pairs = [(t["loss"], c["loss"]) for t, c in zip(test, control)] + validated
    loss_diff = max(abs(t - c) for t, c in pairs)
    norm_diff = max(abs(t["grad_norm"] - c["grad_norm"]) / c["grad_norm"] for t, c in zip(test, control))
    measured(f"compile {name:42s} max |dloss| {loss_diff:.1e}, max grad-norm rel diff {norm_diff:.1e} over "
             f"{STEPS} steps; {run['graphs']} graphs, {run['graph_breaks']} breaks, {run['seconds']:.0f} s")
    assert run["graphs"] >= 1  # it was compiled (not silently run eagerly)
    assert loss_diff <= LOSS_ATOL and norm_diff <= NORM_RTOL


@pytest.mark.parametrize("name", [n for n, (ref, _) in {**RUNS_2, **RUNS_8}.items() if ref])
def test_compiled_layout_equals_eager(name, results, measured):
    compare(name, results, measured)


@pytest.mark.parametrize("name", [n for n in EXTRA_NAMES if not n.endswith("eager") and "float16" not in n])
def test_compiled_option_equals_eager(name, results, measured):
    compare(name, results, measured)


# Unit roundoff of the format: float16 keeps 11 significant bits, bfloat16 8.
ROUNDOFF = {"float16": 2 ** -11, "bfloat16": 2 ** -8}


@pytest.mark.parametrize("name", [n for n in EXTRA_NAMES if "float16" in n and n.endswith("compiled")])
def test_compiled_low_precision_equals_eager_to_its_precision(name, results, measured):
    """float16 (with dynamic loss scaling) and bfloat16 (parameters, gradients and optimizer state),
    compiled: the same losses as eager to two units of the format's roundoff, and under float16
    the same overflows, skipped steps and loss scales. Inductor keeps the intermediates of a fused
    kernel in float32 where eager rounds each op's result, so the two round at different places; a
    wrong gradient is caught in float32 by the matrix above."""
    run, reference = results(name)
    test, control = run["metrics"], reference["metrics"]
    skipped = [r["step"] for r in control if r.get("step_skipped")]
    if name.startswith("float16"):
        keys = ("step", "loss_scale", "skipped_steps", "step_skipped")
        assert [[r[k] for k in keys] for r in test] == [[r[k] for k in keys] for r in control]
        assert 0 < len(skipped) < STEPS  # the overflow path and the update path both ran
    loss_diff = max(abs(t["loss"] - c["loss"]) / c["loss"] for t, c in zip(test, control))
    measured(f"compile {name:42s} max relative |dloss| {loss_diff:.1e} over {STEPS} steps (skipped {skipped})")
    assert run["graphs"] >= 1 and loss_diff <= 2 * ROUNDOFF[name.split()[0]]

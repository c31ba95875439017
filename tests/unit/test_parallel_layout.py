"""Pipeline stage planning and the layout checks that run before any process starts."""

from __future__ import annotations

import json
import re

import pytest

from trainer.config.manager import ConfigError, load_config
from trainer.parallel.dims import ParallelDims, layout_problems
from trainer.parallel.stages import StageError, check_microbatches, plan_stages
from trainer.preflight.checks import plan_run


# ---------------------------------------------------------------------------------------------
# Stage planning


def test_single_stage_split_counts_embedding_and_output_as_layers():
    plan = plan_stages(32, 8, "1F1B", None, 1, 1)
    # 34 virtual layers over 8 stages: 5,5,4,4,4,4,4,4; the first gives one to the embedding,
    # the last one to the output.
    assert [len(b) for b in plan.blocks] == [4, 5, 4, 4, 4, 4, 4, 3]
    assert plan.blocks[0] == (0, 1, 2, 3) and plan.blocks[-1] == (29, 30, 31)
    assert [b for stage in plan.blocks for b in stage] == list(range(32))  # every block exactly once
    assert [plan.rank_of_stage(s) for s in range(8)] == list(range(8))


def test_interleaved_schedules_get_two_stages_per_rank_in_a_loop():
    plan = plan_stages(8, 2, "Interleaved1F1B", None, 1, 1)
    assert plan.num_stages == 4 and plan.stages_per_rank == 2
    assert plan.blocks == ((0, 1), (2, 3, 4), (5, 6), (7,))
    assert plan.stages_of_rank(0) == [0, 2] and plan.stages_of_rank(1) == [1, 3]


def test_v_schedules_put_first_and_last_stage_on_rank_zero():
    plan = plan_stages(8, 2, "ZBVZeroBubble", None, 1, 1)
    assert plan.stages_of_rank(0) == [0, 3] and plan.stages_of_rank(1) == [1, 2]
    assert plan_stages(8, 4, "DualPipeV", None, 0, 0).stages_of_rank(1) == [1, 6]


def test_layers_per_stage_sets_the_number_of_stages():
    plan = plan_stages(6, 2, "Interleaved1F1B", 2, 1, 1)  # 8 virtual layers / 2 = 4 stages
    assert plan.blocks == ((0,), (1, 2), (3, 4), (5,))
    assert plan_stages(6, 2, "LoopedBFS", 1, 1, 1).num_stages == 8
    assert plan.describe().startswith("stage 0 (pp rank 0): embedding, layer 0; stage 1 (pp rank 1): layer 1, layer 2")


def test_without_less_layers_blocks_split_evenly():
    assert plan_stages(4, 2, "Interleaved1F1B", None, 0, 0).blocks == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize("args, message", [
    ((2, 2, "Interleaved1F1B", None, 0, 0), "needs 4 stages, but the model has only 2 layers"),
    ((8, 2, "1F1B", 3, 1, 1), "1F1B runs exactly one stage per PP rank"),
    ((8, 2, "Interleaved1F1B", 2, 1, 1), "gives 5 stages, but Interleaved1F1B needs a multiple of 2"),
    ((8, 2, "Interleaved1F1B", 5, 1, 1), "at least 2 per PP rank"),
    ((6, 2, "ZBVZeroBubble", 1, 1, 1), "gives 8 stages, but ZBVZeroBubble runs exactly 2 stages per PP rank"),
    ((2, 2, "Interleaved1F1B", None, 4, 0), "stage 1 of 4 would hold no layers"),
    ((8, 2, "1F1B", None, -1, 1), "first_stage_less_layers: must be >= 0"),
    ((8, 2, "Zigzag", None, 1, 1), "unknown schedule 'Zigzag'"),
])
def test_impossible_stage_splits(args, message):
    with pytest.raises(StageError, match=message):
        plan_stages(*args)


@pytest.mark.parametrize("schedule, local, micro, pp, stages, expected", [
    ("GPipe", 1, 1, 4, 4, 1),
    ("1F1B", 8, 2, 4, 4, 4),
    ("Interleaved1F1B", 4, 1, 2, 4, 4),
    ("Interleaved1F1B", 6, 1, 4, 8, 6),  # one round of 6
    ("ZBVZeroBubble", 4, 1, 2, 4, 4),
])
def test_microbatches_schedules_accept(schedule, local, micro, pp, stages, expected):
    assert check_microbatches(schedule, local, micro, pp, stages) == expected


@pytest.mark.parametrize("schedule, local, micro, pp, stages, message", [
    ("1F1B", 6, 4, 2, 2, "local_batch_size=6 is not a multiple of parallelism.pipeline_parallel_microbatch_size=4"),
    ("1F1B", 2, 1, 4, 4, "needs at least 4 microbatches, .* gives 2; raise the local batch size to 4"),
    ("Interleaved1F1B", 1, 1, 2, 4, "needs at least 2 microbatches"),
    ("ZBVZeroBubble", 2, 1, 2, 4, "needs at least 4 microbatches"),
    ("DualPipeV", 6, 2, 2, 4, "needs at least 4 microbatches, .* gives 3; raise the local batch size to 8"),
    ("Interleaved1F1B", 9, 1, 4, 8, "in 2 equal rounds .* gives 9; use a multiple of 4 microbatches"),
])
def test_microbatches_schedules_refuse(schedule, local, micro, pp, stages, message):
    with pytest.raises(StageError, match=message):
        check_microbatches(schedule, local, micro, pp, stages)


def test_microbatches_of_all_accumulation_steps_count_together():
    """The accumulation steps of an optimizer step share one schedule step: its microbatches are
    local / microbatch size x accumulation steps, and the schedule's rules apply to that number."""
    assert check_microbatches("1F1B", 1, 1, 2, 2, accumulation_steps=2) == 2
    assert check_microbatches("Interleaved1F1B", 2, 1, 2, 4, accumulation_steps=3) == 6
    with pytest.raises(StageError, match="needs at least 4 microbatches, but training.local_batch_size=1 / "
                       "pipeline_parallel_microbatch_size=1 x 2 accumulation steps gives 2; raise the local batch "
                       "size to 2"):
        check_microbatches("1F1B", 1, 1, 4, 4, accumulation_steps=2)
    with pytest.raises(StageError, match="in 4 equal rounds .* x 3 accumulation steps gives 9"):
        check_microbatches("Interleaved1F1B", 3, 1, 2, 4, accumulation_steps=3)  # 3 alone would be one round


def test_pipeline_accumulation_in_the_layout_check():
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "1"]
    assert problems(4, *pp2, "--training.global_batch_size", "4") == []  # 2 accumulation steps: 2 microbatches
    # Validation runs one local batch (one microbatch here) per schedule step, which 1F1B at PP 2 refuses.
    found = problems(4, *pp2, "--training.global_batch_size", "4", "--validation.enable")
    assert any(p.startswith("validation.enable: validation runs one local batch per pipeline schedule step: 1F1B "
                            "with 2 PP ranks and 2 stages needs at least 2 microbatches") for p in found), found


# ---------------------------------------------------------------------------------------------
# Layout against model, batch and options


def problems(nproc: int, *args: str) -> list[str]:
    config = load_config(["--model.flavor", "tiny", "--training.seq_len", "32", *args])
    return layout_problems(config, ParallelDims.from_config(config.parallelism, nproc))


def test_a_valid_4d_layout_has_no_problems():
    assert problems(16, "--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4") == []


@pytest.mark.parametrize("nproc, args, message", [
    (4, ["--parallelism.tensor_parallel_degree", "4"], "n_kv_heads \\(2\\) is not divisible by it"),
    (3, ["--parallelism.tensor_parallel_degree", "3", "--model.flavor", "debugmodel", "--training.seq_len", "48"],
     "n_heads \\(16\\) is not divisible by it; choose a degree that divides 16"),
    (2, ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"],
     "training.seq_len=30: context_parallel_degree=2 splits sequences into 2 x 2 equal chunks; use a multiple of 4"),
    (8, ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4",
         "--model.flavor", "debugmodel", "--training.seq_len", "36"],
     "sequence parallelism splits each rank's 18 tokens over tensor_parallel_degree=4 ranks; use a multiple of 16"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"], "use a multiple of 2"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--validation.enable", "--validation.seq_len", "31"],
     "validation.seq_len=31"),
    (2, ["--parallelism.enable_async_tensor_parallel"], "needs tensor_parallel_degree > 1 and compile.enable"),
    (4, ["--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule",
         "Interleaved1F1B"], "needs 8 stages, but the model has only 4 layers"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "1"],
     "1F1B with 2 PP ranks and 2 stages needs at least 2 microbatches"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
         "--compile.enable"], "zero-bubble schedules split backward in two"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--validation.enable", "--validation.local_batch_size", "2"],
     "validation runs through the training pipeline"),
    (1, ["--parallelism.tensor_parallel_sync", "per_block"], "tensor_parallel_degree is 1 \\(nothing to drop\\)"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.tensor_parallel_sync", "grouped"],
     "tensor_parallel_sync_group=0: .* needs the number of blocks per synchronization, 1 to the model's 4 layers"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.tensor_parallel_sync_group", "2"],
     "only used with tensor_parallel_sync = \"grouped\" \\(it is 'full'\\)"),
    (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.tensor_parallel_sync", "grouped", "--parallelism.tensor_parallel_sync_group", "3"],
     "pipeline stage 0 holds layers 0-1, which cuts a group of 3 blocks"),
])
def test_each_impossible_layout_names_its_fix(nproc, args, message):
    found = problems(nproc, *args)
    assert any(re.search(message, problem) for problem in found), found


def test_reduced_sync_groups_that_end_with_the_pipeline_stages_are_accepted():
    grouped = ["--parallelism.tensor_parallel_sync", "grouped", "--parallelism.tensor_parallel_sync_group"]
    assert problems(4, "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
                    *grouped, "2") == []
    assert problems(2, "--parallelism.tensor_parallel_degree", "2", *grouped, "3") == []  # groups of 3 and 1


def test_plan_run_lists_every_problem_at_once():
    config = load_config(["--model.flavor", "tiny", "--training.seq_len", "30", "--parallelism.tensor_parallel_degree",
                          "4", "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError) as error:
        plan_run(config, 8)
    message = str(error.value)
    assert message.startswith("parallel layout (pp=1 dp_replicate=1 dp_shard=1 cp=2 tp=4) does not fit this job")
    assert "n_kv_heads (2)" in message and "training.seq_len=30" in message


def test_degrees_that_do_not_fill_the_world_are_refused_before_the_model():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by the product of the other degrees"):
        plan_run(load_config(["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree",
                              "2"]), 6)


@pytest.mark.parametrize("config_file, world, degrees, accumulation", [
    ("llama3_8b.toml", 8, {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1}, 1),
    ("llama3_70b.toml", 64, {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 8}, 1),
    ("llama3_405b.toml", 512, {"pp": 8, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 8}, 1),
])
def test_presets_fit_the_clusters_they_are_sized_for(config_file, world, degrees, accumulation):
    plan = plan_run(load_config(["--job.config_file", config_file]), world)
    assert plan.dims.degrees() == degrees and plan.accumulation_steps == accumulation


def test_405b_pipeline_has_sixteen_stages_of_about_eight_layers():
    from trainer.parallel.dims import stage_plan

    config = load_config(["--job.config_file", "llama3_405b.toml"])
    plan = stage_plan(config, ParallelDims.from_config(config.parallelism, 512))
    assert plan.num_stages == 16 and plan.stages_of_rank(0) == [0, 8]
    assert [len(b) for b in plan.blocks] == [7] + [8] * 14 + [7]


def test_a_split_of_ones_own_gives_the_stages_it_names():
    parts = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4"],
             ["layers.5", "norm", "output"]]
    plan = plan_stages(6, 2, "Interleaved1F1B", None, 1, 1, parts)
    assert plan.blocks == ((0,), (1, 2), (3, 4), (5,)) and plan.stages_of_rank(1) == [1, 3]
    assert plan_stages(4, 2, "1F1B", None, 1, 1, [["tok_embeddings"], ["layers.0", "layers.1", "layers.2", "layers.3",
                                                                       "norm", "output"]]).blocks == ((), (0, 1, 2, 3))


@pytest.mark.parametrize("parts, message", [
    ([["layers.0", "layers.1"], ["tok_embeddings", "layers.2", "layers.3", "norm", "output"]],
     "part 0 holds none of tok_embeddings, norm and output; the first part takes tok_embeddings, the last norm and output"),
    ([["tok_embeddings", "layers.0", "layers.2"], ["layers.1", "layers.3", "norm", "output"]],
     "the parts must hold layers.0 to layers.3 once each and in order; they hold 0, 2, 1, 3"),
    ([["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm", "output"]],
     "the parts must hold layers.0 to layers.3 once each and in order; they hold 0, 1, 2"),
    ([["tok_embeddings", "layers.0"], ["attention", "layers.1", "layers.2", "layers.3", "norm", "output"]],
     "'attention' in part 1 is not a module of the model; name tok_embeddings, layers.0 to layers.3, norm and output"),
    ([["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2", "layers.3", "norm", "output"]],
     "3 parts, but 1F1B on 2 PP ranks runs exactly 2 stages (one per PP rank)"),
])
def test_a_split_of_ones_own_that_cannot_work_names_what_is_wrong(parts, message):
    with pytest.raises(StageError, match="parallelism.module_fqns_per_model_part: " + re.escape(message)):
        plan_stages(4, 2, "1F1B", None, 1, 1, parts)


def test_a_split_of_ones_own_is_a_toml_list_of_lists_or_json_on_the_command_line(tmp_path):
    parts = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]
    path = tmp_path / "job.toml"
    path.write_text(f"[parallelism]\npipeline_parallel_degree = 2\nmodule_fqns_per_model_part = {parts!r}\n"
                    .replace("'", '"'))
    from_file = load_config(["--job.config_file", str(path), "--model.flavor", "tiny"])
    from_argv = load_config(["--model.flavor", "tiny", "--parallelism.pipeline_parallel_degree", "2",
                             "--parallelism.module_fqns_per_model_part", json.dumps(parts)])
    assert from_file.parallelism.module_fqns_per_model_part == from_argv.parallelism.module_fqns_per_model_part == parts
    assert plan_run(from_argv, 2).dims.pp == 2
    for text in ("tok_embeddings,layers.0", "[" * 100_000):  # not JSON; nested deeper than Python reads
        with pytest.raises(ConfigError, match=r'a list of lists, written as JSON: \[\["a", "b"\], \["c"\]\]'):
            load_config(["--parallelism.module_fqns_per_model_part", text])
    with pytest.raises(ConfigError, match="module_fqns_per_model_part: splits the model into pipeline stages; set "
                                          "parallelism.pipeline_parallel_degree >= 2"):
        load_config(["--parallelism.module_fqns_per_model_part", json.dumps(parts)])

"""The plan model: validation messages (one rule broken at a time), expansion into launches, and
the two shipped plans."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from protocol.plan.load import PlanError, load_plan
from protocol.plan.model import REPO_ROOT, perturbation_seed, slugify
from protocol.plan.options import override_args
from protocol.plan.tolerance import Tolerance

PLANS = REPO_ROOT / "protocol" / "plans"

BASE = """
[plan]
name = "small"
config = "debug_model.toml"
output = "{output}"
steps = 4
warmup_steps = 1
local_batch_size = 4
dp_degree = 2
overrides = {{ "model.flavor" = "tiny", "training.seq_len" = 32 }}
{plan_extra}

[tolerance]
{tolerance}

[control]
name = "control"
{control}

{sets}
"""

TP_SET = """
[[sets]]
name = "FSDP+TP2"
kind = "parallelism"
tp = 2
"""


def plan_text(tmp_path: Path, plan_extra: str = "", tolerance: str = 'mode = "exact"', control: str = "",
              sets: str = TP_SET) -> str:
    return BASE.format(output=tmp_path / "out", plan_extra=plan_extra, tolerance=tolerance, control=control,
                       sets=sets)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(text)
    return path


def load(tmp_path: Path, **parts):
    return load_plan(write(tmp_path, plan_text(tmp_path, **parts)))


def problems(tmp_path: Path, text: str | None = None, **parts) -> str:
    with pytest.raises(PlanError) as info:
        load_plan(write(tmp_path, text if text is not None else plan_text(tmp_path, **parts)))
    return str(info.value)


def arg(launch, key: str) -> str | None:
    """The value of option `key` in a launch (the last one given), None when it has none."""
    args = list(launch.args)
    if key not in args:
        return None
    return args[len(args) - 1 - args[::-1].index(key) + 1]


# ---------------------------------------------------------------------------------------------
# The shipped plans


def test_cpu_smoke_expands_into_seed_control_and_small_sets():
    plan = load_plan(PLANS / "cpu_smoke.toml")
    launches = plan.launches()
    assert [(l.name, l.role, l.kind, l.nproc, l.nodes) for l in launches] == [
        ("seed", "seed", "seed", 1, 1),
        ("1D FSDP", "control", "control", 2, 1),
        ("3D FSDP+TP2+PP2", "test", "parallelism", 8, 1),
        ("4D FSDP+TP2+CP2+PP2", "test", "parallelism", 16, 1),
        ("2D FSDP+TP2 compiled", "test", "parallelism", 4, 1),
        ("2D FSDP+CP2", "test", "parallelism", 4, 1),
        ("AC full", "test", "technique", 2, 1),
    ]
    assert max(l.nproc for l in launches) <= plan.gpus_per_node  # every run fits this one machine
    assert plan.tolerance.mode == "exact"
    assert launches[2].degrees == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1, "pp": 2,
                                   "pp_schedule": "Interleaved1F1B"}
    assert launches[3].degrees == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 2, "pp": 2,
                                   "pp_schedule": "Interleaved1F1B"}
    assert launches[4].degrees == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1, "pp": 1}
    assert "--compile.enable=true" in launches[4].args
    assert arg(launches[4], "--activation_checkpoint.selective_ac_option") == "2"
    assert launches[5].degrees == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 2, "pp": 1}
    seed_path = plan.output / "seed" / "checkpoint" / "step-0"
    assert plan.seed_checkpoint_path == seed_path
    for launch in launches[1:]:
        assert arg(launch, "--training.local_batch_size") == "4"
        assert arg(launch, "--training.global_batch_size") == "-1"
        assert arg(launch, "--training.steps") == "20"
        assert arg(launch, "--lr_scheduler.warmup_steps") == "2"
        assert arg(launch, "--model.flavor") == "tiny" and arg(launch, "--training.seq_len") == "32"
        assert "--debug.deterministic=true" in launch.args
        assert launch.args[-8:] == ("--checkpoint.enable=true", "--checkpoint.interval", "10",
                                    "--checkpoint.keep_latest_k", "1", "--checkpoint.last_save_model_only=false",
                                    "--checkpoint.initial_load_path", str(seed_path))
        assert launch.output == plan.output / slugify(launch.name)
        assert launch.depends_on == ("seed",)
    assert arg(launches[6], "--activation_checkpoint.mode") == "full"
    assert arg(launches[3], "--parallelism.pipeline_parallel_microbatch_size") == "2"


def test_cpu_smoke_commands_are_exact():
    plan = load_plan(PLANS / "cpu_smoke.toml")
    seed, control = plan.launches()[:2]
    common = ("--training.dataset synthetic_context --model.flavor tiny --training.seq_len 32 --optimizer.lr 0.003 "
              "--optimizer.weight_decay 0.0 "
              "--metrics.log_freq 1 --metrics.enable_tensorboard=false --debug.deterministic=true --debug.seed 0")
    assert seed.command() == (f"./torchrun_launch.sh --job.config_file debug_model.toml --job.dump_folder "
                              f"{plan.output / 'seed'} {common} --checkpoint.create_seed_checkpoint")
    assert control.command() == (
        f"NGPU=2 ./torchrun_launch.sh --job.config_file debug_model.toml --job.dump_folder {plan.output / '1d-fsdp'} "
        f"--metrics.fingerprints=true --training.mixed_precision_param float32 {common} --training.steps 20 --lr_scheduler.warmup_steps 2 --training.local_batch_size 4 "
        "--training.global_batch_size -1 --parallelism.data_parallel_replicate_degree 1 "
        "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1 "
        "--parallelism.context_parallel_degree 1 --parallelism.pipeline_parallel_degree 1 "
        "--checkpoint.enable=true --checkpoint.interval 10 --checkpoint.keep_latest_k 1 "
        f"--checkpoint.last_save_model_only=false --checkpoint.initial_load_path {plan.seed_checkpoint_path}")


def test_training_runs_record_fingerprints_unless_the_plan_says_otherwise(tmp_path):
    """Fingerprints let the report say where a set parts from the control: on in every training
    run (not the seed job); a plan's (or a set's) own metrics.fingerprints wins."""
    plan = load_plan(PLANS / "cpu_smoke.toml")
    seed, *runs = plan.launches()
    assert "--metrics.fingerprints=true" not in seed.args
    assert all(run.args.count("--metrics.fingerprints=true") == 1 for run in runs)
    text = (PLANS / "cpu_smoke.toml").read_text().replace('[plan.overrides]\n', '[plan.overrides]\n"metrics.fingerprints" = false\n')
    assert '"metrics.fingerprints" = false' in text
    (tmp_path / "off.toml").write_text(text.replace('output = "', f'output = "{tmp_path}/'))
    off = load_plan(tmp_path / "off.toml").launches()
    assert all("--metrics.fingerprints=true" not in run.args and "--metrics.fingerprints=false" in run.args
               for run in off[1:])


def test_cpu_statistical_plan_is_bf16_with_noise_controls_and_a_positive_control():
    plan = load_plan(PLANS / "cpu_statistical.toml")
    launches = plan.launches()
    assert [(l.name, l.role, l.nproc, l.expect) for l in launches] == [
        ("seed", "seed", 1, "pass"), ("1D FSDP", "control", 2, "pass"),
        *[(f"1D FSDP-noise{k}", "noise", 2, "pass") for k in range(1, 5)],
        ("2D FSDP+TP2", "test", 4, "pass"), ("2D FSDP+PP2", "test", 4, "pass"), ("lr x1.05", "test", 2, "fail"),
        ("lr x1.02", "test", 2, "fail")]
    # the defaults but for a longer final window (the plan says why)
    assert plan.tolerance == Tolerance(mode="statistical", final_window=0.2)
    for launch in launches[1:]:
        assert arg(launch, "--training.mixed_precision_param") == "bfloat16"
        assert (arg(launch, "--training.steps"), arg(launch, "--debug.seed")) == ("300", "0")  # same data everywhere
        assert arg(launch, "--training.dataset") == "synthetic_context"  # attention and positions matter on it
    assert arg(launches[-2], "--optimizer.lr") == "0.00315" and arg(launches[-1], "--optimizer.lr") == "0.00306"


def test_converging_llama3_8b_validates_at_128_gpus():
    plan = load_plan(PLANS / "converging_llama3_8b.toml")
    launches = plan.launches()
    assert plan.tolerance.mode == "statistical" and plan.tolerance.noise_controls == 6
    assert [(l.name, l.role, l.seed, l.nproc, l.nodes, l.procs_per_node) for l in launches] == [
        ("seed", "seed", 0, 1, 1, 1),
        ("1D FSDP", "control", 0, 16, 2, 8),
        *[(f"1D FSDP-noise{k}", "noise", 0, 16, 2, 8) for k in range(1, 7)],
        ("3D FSDP+TP2+PP2", "test", 0, 64, 8, 8),
        ("4D FSDP+TP2+CP2+PP2", "test", 0, 128, 16, 8),
        ("2D FSDP+CP8", "test", 0, 128, 16, 8),
        ("lr x1.05", "test", 0, 16, 2, 8),
    ]
    assert launches[-1].expect == "fail" and arg(launches[-1], "--optimizer.lr") == "0.000315"
    assert launches[9].degrees == {"dp_replicate": 1, "dp_shard": 16, "tp": 2, "cp": 2, "pp": 2,
                                   "pp_schedule": "Interleaved1F1B"}
    assert launches[10].degrees == {"dp_replicate": 1, "dp_shard": 16, "tp": 1, "cp": 8, "pp": 1}
    for launch in launches[1:]:
        assert arg(launch, "--job.config_file") == "llama3_8b.toml"
        assert (arg(launch, "--training.steps"), arg(launch, "--lr_scheduler.warmup_steps")) == ("3000", "600")
        assert arg(launch, "--training.local_batch_size") == "4"
        assert arg(launch, "--parallelism.data_parallel_shard_degree") == "16"
        assert arg(launch, "--debug.seed") == str(launch.seed)


def test_multi_node_command_uses_a_rendezvous_and_the_seed_has_no_ngpu():
    plan = load_plan(PLANS / "converging_llama3_8b.toml")
    seed, control = plan.launches()[:2]
    assert seed.command().startswith("./torchrun_launch.sh --job.config_file llama3_8b.toml")
    assert "NGPU" not in seed.command() and seed.command().endswith("--checkpoint.create_seed_checkpoint")
    command = control.command()
    assert command.startswith("PYTHONPATH=. python -m trainer.launch --nproc 8 --device cuda --nnodes 2 "
                              '--rdzv-endpoint "${HEAD_NODE:?first node}:29500" --rdzv-id 1d-fsdp ')
    assert command.endswith(" " + shlex.join(control.args))


# ---------------------------------------------------------------------------------------------
# Expansion


def test_statistical_mode_adds_noise_controls_on_the_same_data(tmp_path):
    plan = load(tmp_path, plan_extra="seed = 7", tolerance='mode = "statistical"\nnoise_controls = 2\nperturbation = 0.5')
    launches = plan.launches()
    assert [(l.name, l.role, l.seed) for l in launches] == [
        ("seed", "seed", 7), ("control", "control", 7), ("control-noise1", "noise", 7),
        ("control-noise2", "noise", 7), ("FSDP+TP2", "test", 7)]
    # Paired: every run has the plan's seed (the same data, the same weights) ...
    assert [arg(l, "--debug.seed") for l in launches] == ["7"] * 5
    # ... and every training run starts from them perturbed at rounding level, with a seed of its own
    assert [arg(l, "--debug.init_perturbation") for l in launches] == [None] + ["0.5"] * 4
    seeds = [arg(l, "--debug.init_perturbation_seed") for l in launches[1:]]
    assert len(set(seeds)) == 4 and seeds == [str(perturbation_seed(l.name)) for l in launches[1:]]
    noise, control = list(launches[2].args), list(launches[1].args)
    renamed = [a.replace(str(plan.output / "control"), str(plan.output / "control-noise1")) for a in control]
    assert [(a, b) for a, b in zip(noise, renamed) if a != b] == [(seeds[1], seeds[0])]  # nothing else differs
    assert launches[2].output == plan.output / "control-noise1"
    # Every run starts from the one seed checkpoint, made with the plan's seed.
    assert {arg(l, "--checkpoint.initial_load_path") for l in launches[1:]} == {str(plan.seed_checkpoint_path)}
    # A run's perturbation seed depends on its own name only: adding a set changes no other run.
    more = load(tmp_path, plan_extra="seed = 7", tolerance='mode = "statistical"\nnoise_controls = 2\nperturbation = 0.5',
                sets=TP_SET + TP_SET.replace("FSDP+TP2", "another"))
    assert [arg(l, "--debug.init_perturbation_seed") for l in more.launches()[1:5]] == seeds


def test_exact_mode_runs_the_control_once(tmp_path):
    plan = load(tmp_path, tolerance='mode = "exact"\nnoise_controls = 5')
    assert [l.name for l in plan.launches()] == ["seed", "control", "FSDP+TP2"]


def test_a_positive_control_is_a_set_that_expects_to_fail(tmp_path):
    plan = load(tmp_path, sets=TP_SET + '[[sets]]\nname = "lr x1.05"\nkind = "technique"\nexpect = "fail"\n'
                                        'overrides = { "optimizer.lr" = 3.15e-3 }\n')
    assert [(l.name, l.expect) for l in plan.launches()[2:]] == [("FSDP+TP2", "pass"), ("lr x1.05", "fail")]
    message = problems(tmp_path, sets=TP_SET.replace('kind = "parallelism"', 'kind = "parallelism"\nexpect = "fial"'))
    assert "sets[0].expect: 'fial' is not one of 'pass', 'fail'; did you mean 'fail'?" in message


def test_a_float8_set_changes_model_converters_and_its_fingerprints_only_localize(tmp_path):
    """model.converters is a technique a set may turn on (float8 linear layers), unlike the other
    model.* keys; its set says its fingerprints only localize (they differ by design)."""
    float8 = ('[[sets]]\nname = "float8"\nkind = "technique"\nfingerprints = "localize"\n'
              'overrides = { "model.converters" = ["quantize.linear.float8"] }\n')
    plan = load(tmp_path, sets=float8)
    assert [(spec.name, spec.fingerprints) for spec in plan.sets] == [("float8", "localize")]
    assert arg(plan.launches()[-1], "--model.converters") == "quantize.linear.float8"
    message = problems(tmp_path, sets=float8.replace('"localize"', '"localise"').replace("model.converters",
                                                                                         "model.flavor"))
    assert "sets[0].fingerprints: 'localise' is not one of 'evidence', 'localize'; did you mean 'localize'?" in message
    assert 'sets[0].overrides."model.flavor": decides the model or the data' in message


def test_without_seed_checkpoint_no_seed_run_and_nothing_to_load(tmp_path):
    plan = load(tmp_path, plan_extra="seed_checkpoint = false")
    launches = plan.launches()
    assert [l.role for l in launches] == ["control", "test"]
    assert all("--checkpoint.initial_load_path" not in l.args and not l.depends_on for l in launches)
    assert plan.seed_checkpoint_path is None


def test_global_batch_mode_lets_a_set_change_dp_and_local_batch(tmp_path):
    sets = '[[sets]]\nname = "FSDP4 x 2"\nkind = "parallelism"\ndp_shard = 4\nlocal_batch_size = 2\n'
    plan = load(tmp_path, plan_extra='batch = "global"', sets=sets)
    control, test = plan.launches()[1:]
    assert (control.nproc, arg(control, "--training.local_batch_size")) == (2, "4")
    assert (test.nproc, arg(test, "--training.local_batch_size")) == (4, "2")
    assert arg(control, "--training.global_batch_size") == arg(test, "--training.global_batch_size") == "8"


def test_technique_set_runs_on_the_control_layout_with_its_overrides(tmp_path):
    sets = '[[sets]]\nname = "compile"\nkind = "technique"\noverrides = { "compile.enable" = true }\n'
    plan = load(tmp_path, sets=sets)
    control, test = plan.launches()[1:]
    assert test.degrees == control.degrees and test.nproc == 2
    assert "--compile.enable=true" in test.args and "--compile.enable=true" not in control.args


def test_a_reduced_tensor_parallel_sync_is_a_technique_not_a_layout(tmp_path):
    reduced = TP_SET + 'overrides = { "parallelism.tensor_parallel_sync" = "per_block" }\n'
    message = problems(tmp_path, sets=reduced)
    assert 'sets[0].overrides."parallelism.tensor_parallel_sync": changes the model, so the set is a technique' in message
    technique = reduced.replace('kind = "parallelism"', 'kind = "technique"')
    test = load(tmp_path, sets=technique).launches()[-1]
    assert test.nproc == 4 and arg(test, "--parallelism.tensor_parallel_sync") == "per_block"


def test_nested_override_tables_equal_dotted_keys(tmp_path):
    text = plan_text(tmp_path).replace('overrides = { "model.flavor" = "tiny", "training.seq_len" = 32 }',
                                       'overrides = { model = { flavor = "tiny" }, training = { seq_len = 32 } }')
    launch = load_plan(write(tmp_path, text)).launches()[1]
    assert arg(launch, "--model.flavor") == "tiny" and arg(launch, "--training.seq_len") == "32"


def test_override_values_become_command_line_text():
    assert override_args({"compile.enable": True, "metrics.enable_tensorboard": False, "optimizer.lr": 0.003,
                          "compile.components": ["model", "loss"], "training.steps": 5,
                          "job.description": "-x"}) == [
        "--compile.enable=true", "--metrics.enable_tensorboard=false", "--optimizer.lr", "0.003",
        "--compile.components", "model,loss", "--training.steps", "5", "--job.description=-x"]


def test_slugs_name_the_run_folders():
    assert slugify("3D FSDP+TP2+PP2") == "3d-fsdp-tp2-pp2"
    assert slugify("  AC (full) ") == "ac-full"
    assert slugify("+++") == "run"


def test_relative_output_is_relative_to_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = plan_text(tmp_path).replace(f'output = "{tmp_path / "out"}"', 'output = "runs/x"')
    plan = load_plan(write(tmp_path, text))
    assert plan.output == tmp_path / "runs" / "x"
    default = load_plan(write(tmp_path, text.replace('output = "runs/x"\n', "")))
    assert default.output == tmp_path / "outputs" / "protocol" / "small"


def test_a_config_outside_train_configs_is_passed_as_an_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "mine.toml").write_text((REPO_ROOT / "train_configs" / "debug_model.toml").read_text())
    monkeypatch.chdir(tmp_path)
    text = plan_text(tmp_path).replace('config = "debug_model.toml"', 'config = "mine.toml"')
    launch = load_plan(write(tmp_path, text)).launches()[1]
    assert arg(launch, "--job.config_file") == str(tmp_path / "mine.toml")


# ---------------------------------------------------------------------------------------------
# Validation: each rule broken once


def test_unreadable_and_invalid_toml(tmp_path):
    with pytest.raises(PlanError, match="cannot be read"):
        load_plan(tmp_path / "missing.toml")
    assert "not valid TOML" in problems(tmp_path, "[plan\n")


def test_unknown_keys_name_the_closest_valid_one(tmp_path):
    message = problems(tmp_path, plan_extra="stpes = 3", control="tpp = 2",
                       sets=TP_SET + "pp_shedule = \"1F1B\"\n")
    assert "plan.stpes: unknown key; did you mean 'steps'?" in message
    assert "control.tpp: unknown key; did you mean 'tp'?" in message
    assert "sets[0].pp_shedule: unknown key; did you mean 'pp_schedule'?" in message
    assert "3 problems" in message


def test_unknown_table(tmp_path):
    assert "[tolerence]: unknown table; did you mean 'tolerance'?" in problems(
        tmp_path, plan_text(tmp_path) + "\n[tolerence]\nmode = 'exact'\n")


def test_wrong_types(tmp_path):
    message = problems(tmp_path, plan_extra='seed_checkpoint = "yes"', sets=TP_SET.replace("tp = 2", 'tp = "2"'))
    assert "plan.seed_checkpoint: expected true or false, got 'yes'" in message
    assert "sets[0].tp: expected an integer, got '2'" in message


def test_missing_required_keys(tmp_path):
    text = plan_text(tmp_path, sets='[[sets]]\nname = "x"\ntp = 2\n').replace("dp_degree = 2\n", "")
    message = problems(tmp_path, text)
    assert "plan.dp_degree: missing (required)" in message
    assert "sets[0].kind: missing (required)" in message


def test_a_plan_needs_test_sets(tmp_path):
    assert "sets: the plan has no test sets" in problems(tmp_path, sets="")


def test_invalid_choices_and_ranges(tmp_path):
    message = problems(tmp_path, plan_extra='batch = "locall"',
                       sets=TP_SET.replace('kind = "parallelism"', 'kind = "parallelsm"') + "cp = 0\n")
    assert "plan.batch: 'locall' is not one of 'local', 'global'; did you mean 'local'?" in message
    assert "sets[0].kind: 'parallelsm' is not one of 'parallelism', 'technique'; did you mean 'parallelism'?" in message
    assert "sets[0].cp: must be >= 1, got 0" in message


def test_unknown_schedule_and_schedule_without_pp(tmp_path):
    sets = TP_SET + 'pp = 2\npp_schedule = "Interleaved1f1b"\n[[sets]]\nname = "b"\nkind = "parallelism"\n' \
                    'cp = 2\npp_schedule = "1F1B"\n'
    message = problems(tmp_path, sets=sets)
    assert "sets[0].pp_schedule: 'Interleaved1f1b' is not one of" in message
    assert "did you mean 'Interleaved1F1B'?" in message
    assert "sets[1].pp_schedule: has no effect without pipeline parallelism; set sets[1].pp >= 2" in message


def test_duplicate_set_names(tmp_path):
    message = problems(tmp_path, sets=TP_SET + TP_SET.replace("FSDP+TP2", "fsdp tp2"))
    assert "sets[1] ('fsdp tp2'): name 'fsdp tp2' gives the output folder 'fsdp-tp2', as sets[0] ('FSDP+TP2') does" \
        in message


def test_a_set_named_like_a_noise_control(tmp_path):
    message = problems(tmp_path, tolerance='mode = "statistical"',
                       sets=TP_SET.replace("FSDP+TP2", "control-noise1"))
    assert "name 'control-noise1' gives the output folder 'control-noise1', as control ('control-noise1') does" in message


def test_tolerance_problems(tmp_path):
    message = problems(tmp_path, tolerance='mode = "exakt"\nloss_atl = 1e-4\nfinal_window = 2.0')
    assert "tolerance.mode: 'exakt' is not one of exact, statistical" in message
    assert "tolerance.loss_atl: unknown key; did you mean 'loss_atol'?" in message
    assert "tolerance.final_window: a fraction in (0, 1], got 2.0" in message
    message = problems(tmp_path, tolerance='mode = "statistical"\nnoise_controls = 1\nobservables = ["loss", "lr"]\n'
                                           'alpha = 1.5')
    assert "tolerance.noise_controls: the noise is measured by the spread of the control and its noise controls; " \
           "give at least 2, got 1" in message
    assert "tolerance.observables: ['loss', 'lr']: choose one or more of 'loss', 'grad_norm'" in message
    assert "tolerance.alpha: a probability in (0, 1), got 1.5" in message
    # A plan written for the earlier seed-repeat design is told what replaced its keys.
    message = problems(tmp_path, tolerance='mode = "statistical"\ncontrol_repeats = 3\nnoise_multiplier = 2.0')
    assert "tolerance.control_repeats: no longer a key; use noise_controls" in message
    assert "tolerance.noise_multiplier: no longer a key; use margin_sigmas" in message


def test_missing_base_config(tmp_path):
    message = problems(tmp_path, plan_text(tmp_path).replace("debug_model.toml", "nope.toml"))
    assert "plan.config: 'nope.toml' not found" in message and "llama3_8b.toml" in message


def test_unknown_and_mistyped_trainer_options(tmp_path):
    message = problems(tmp_path, plan_extra="", sets=TP_SET + 'overrides = { "model.flavr" = "tiny" }\n'
                       '[[sets]]\nname = "c"\nkind = "technique"\noverrides = { "compile.enable" = "yes", '
                       '"compil.enable" = true, "flavor" = 1 }\n')
    assert "sets[0].overrides.\"model.flavr\": unknown option model.flavr; did you mean 'flavor'?" in message
    assert "sets[1].overrides.\"compile.enable\": expected true or false, got 'yes'" in message
    assert "sets[1].overrides.\"compil.enable\": not a trainer option" in message
    assert "did you mean 'compile'?" in message
    assert "sets[1].overrides.\"flavor\": not a trainer option" in message


def test_overrides_may_not_set_what_the_plan_sets(tmp_path):
    sets = TP_SET + 'overrides = { "parallelism.tensor_parallel_degree" = 4, "training.local_batch_size" = 2 }\n'
    message = problems(tmp_path, sets=sets, control='overrides = { "debug.seed" = 3 }')
    assert ("sets[0].overrides.\"parallelism.tensor_parallel_degree\": set by the plan; use the set's tp "
            "instead") in message
    assert "sets[0].overrides.\"training.local_batch_size\": set by the plan; use plan.local_batch_size" in message
    assert "control.overrides.\"debug.seed\": set by the plan; use plan.seed instead" in message
    text = plan_text(tmp_path).replace('"training.seq_len" = 32', '"training.seq_len" = 32, "training.steps" = 9')
    assert "plan.overrides.\"training.steps\": set by the plan; use plan.steps instead" in problems(tmp_path, text)


def test_seed_loading_options_belong_to_the_plan_only_with_a_seed_checkpoint(tmp_path):
    text = plan_text(tmp_path).replace('"training.seq_len" = 32', '"training.seq_len" = 32, '
                                       '"checkpoint.initial_load_path" = "/x"')
    assert "use plan.seed_checkpoint instead" in problems(tmp_path, text)


def test_model_and_data_options_are_the_same_for_every_run(tmp_path):
    sets = TP_SET + 'overrides = { "training.seq_len" = 64, "model.flavor" = "debugmodel" }\n'
    message = problems(tmp_path, sets=sets)
    assert "sets[0].overrides.\"training.seq_len\": decides the model or the data" in message
    assert "sets[0].overrides.\"model.flavor\": decides the model or the data" in message
    assert "set it in plan.overrides" in message


def test_technique_set_needs_overrides(tmp_path):
    message = problems(tmp_path, sets='[[sets]]\nname = "t"\nkind = "technique"\n')
    assert "sets[0].overrides: a technique set needs the trainer options that turn the technique on" in message


def test_parallelism_set_equal_to_the_control_tests_nothing(tmp_path):
    message = problems(tmp_path, sets='[[sets]]\nname = "same"\nkind = "parallelism"\n')
    assert "sets[0]: its layout and batch equal the control's, so it would test nothing" in message


def test_local_batch_mode_keeps_dp_degree_and_local_batch(tmp_path):
    sets = TP_SET + 'dp_shard = 4\n[[sets]]\nname = "b"\nkind = "parallelism"\ncp = 2\nlocal_batch_size = 2\n' \
                    '[[sets]]\nname = "c"\nkind = "parallelism"\ndp_replicate = 3\n'
    message = problems(tmp_path, sets=sets)
    assert ("sets[0].dp_shard: dp_replicate 1 x dp_shard 4 gives DP degree 4, but batch = 'local' fixes it at "
            "plan.dp_degree = 2; remove dp_shard, or set plan.batch = 'global'") in message
    assert ("sets[1].local_batch_size: 2 differs from plan.local_batch_size = 4, which batch = 'local' fixes for "
            "every run") in message
    assert "sets[2].dp_replicate: 3 does not divide plan.dp_degree = 2" in message


def test_global_batch_mode_keeps_the_global_batch(tmp_path):
    sets = '[[sets]]\nname = "b"\nkind = "parallelism"\ndp_shard = 4\nlocal_batch_size = 3\n'
    message = problems(tmp_path, plan_extra='batch = "global"', sets=sets)
    assert "sets[0]: local batch x DP degree = 12 does not divide the global batch 8" in message


def test_runs_spanning_nodes_fill_whole_nodes(tmp_path):
    message = problems(tmp_path, plan_extra="gpus_per_node = 3")
    assert ("sets[0] ('FSDP+TP2'): 4 processes span more than one node but do not fill whole nodes of "
            "plan.gpus_per_node = 3") in message


def test_tensor_parallel_degree_must_divide_the_heads(tmp_path):
    message = problems(tmp_path, sets=TP_SET.replace("tp = 2", "tp = 3"))
    assert "sets[0] ('FSDP+TP2') (pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=3): " in message
    assert "parallelism.tensor_parallel_degree=3: the tiny model's n_heads (4) is not divisible by it" in message


def test_seq_len_must_split_for_context_and_tensor_parallelism(tmp_path):
    message = problems(tmp_path, sets='[[sets]]\nname = "cp3"\nkind = "parallelism"\ncp = 3\n')
    assert "sets[0] ('cp3') (pp=1 dp_replicate=1 dp_shard=2 cp=3 tp=1): " in message
    assert "training.seq_len=32: context_parallel_degree=3 splits" in message
    assert "use a multiple of 6" in message
    text = plan_text(tmp_path).replace('"training.seq_len" = 32', '"training.seq_len" = 33')
    message = problems(tmp_path, text)
    assert "sets[0] ('FSDP+TP2') (pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=2): " in message
    assert ("training.seq_len=33: sequence parallelism splits each rank's 33 tokens over tensor_parallel_degree=2 "
            "ranks; use a multiple of 2") in message


def test_pipeline_stages_need_layers(tmp_path):
    sets = '[[sets]]\nname = "pp4"\nkind = "parallelism"\npp = 4\npp_schedule = "Interleaved1F1B"\n'
    message = problems(tmp_path, sets=sets)
    assert "sets[0] ('pp4') (pp=4 dp_replicate=1 dp_shard=2 cp=1 tp=1): " in message
    assert "needs 8 stages, but the model has only 4 layers" in message


def test_pipeline_schedule_needs_enough_microbatches(tmp_path):
    text = plan_text(tmp_path, sets='[[sets]]\nname = "pp2"\nkind = "parallelism"\npp = 2\npp_schedule = "1F1B"\n')
    message = problems(tmp_path, text.replace("local_batch_size = 4", "local_batch_size = 1"))
    assert "1F1B with 2 PP ranks and 2 stages needs at least 2 microbatches" in message
    assert "raise the local batch size to 2" in message


def test_interleaved_schedule_needs_two_stages_per_rank(tmp_path):
    sets = '[[sets]]\nname = "pp2"\nkind = "parallelism"\npp = 2\npp_schedule = "Interleaved1F1B"\n' \
           'overrides = { "parallelism.pipeline_parallel_layers_per_stage" = 3 }\n'
    message = problems(tmp_path, sets=sets)
    assert "pipeline_parallel_layers_per_stage=3 gives 2 stages, but Interleaved1F1B needs a multiple of 2 " \
           "stages, at least 2 per PP rank" in message


def test_invalid_common_option_value_is_reported_once_for_the_plan(tmp_path):
    text = plan_text(tmp_path).replace('"model.flavor" = "tiny"', '"model.flavor" = "huge"')
    message = problems(tmp_path, text)
    assert "plan: invalid configuration: model.flavor: 'huge' is unknown" in message
    assert "1 problem:" in message


def test_every_problem_is_listed_at_once(tmp_path):
    sets = TP_SET.replace("tp = 2", "tp = 3") + '[[sets]]\nname = "t"\nkind = "technique"\n' + \
        '[[sets]]\nname = "cp"\nkind = "parallelism"\ncp = 2\nlocal_batch_size = 8\n'
    message = problems(tmp_path, sets=sets, tolerance='mode = "exact"\nloss_atol = -1.0')
    assert "tolerance.loss_atol: must be > 0" in message
    assert "sets[1].overrides: a technique set needs" in message
    assert "sets[2].local_batch_size: 8 differs" in message
    assert "tensor_parallel_degree=3" in message


def test_a_bad_optional_plan_key_does_not_hide_the_other_problems(tmp_path):
    message = problems(tmp_path, plan_extra="stpes = 3", sets=TP_SET.replace("tp = 2", "tp = 3"))
    assert "plan.stpes: unknown key; did you mean 'steps'?" in message
    assert "parallelism.tensor_parallel_degree=3: the tiny model's n_heads (4)" in message


def test_every_key_is_described():
    from protocol.plan.schema import CONTROL_KEYS, PLAN_KEYS, SET_KEYS, SLURM_KEYS, describe_keys

    text = describe_keys()
    for schema in (PLAN_KEYS, CONTROL_KEYS, SET_KEYS, SLURM_KEYS):
        for key, spec in schema.items():
            assert spec.doc and f"  {key} (" in text


MANY_MISTAKES = """
[plan]
name = "many"
config = "debug_model.toml"
output = "{output}"
steps = {steps}
local_batch_size = 4
dp_degree = 2
{sead}
overrides = {{ "model.flavor" = "tiny", "training.seq_len" = 32 }}

[tolerance]
loss_atol = {atol}

[control]
name = "control"
{tpp}

[[sets]]
name = "A"
kind = "parallelism"
tp = {tp}

[[sets]]
name = "{second}"
kind = "{kind}"
cp = {cp}

[[sets]]
name = "B"
kind = "technique"
pp = {pp}
pp_schedule = "Interleaved1F1B"
overrides = {{ "{lr_key}" = 1e-3 }}

[slurm.seed]
mem = "{mem}"

[slurm.train]
{partition} = "gpu"
"""
WRONG = dict(steps=0, sead="sead = 1", atol=-1.0, tpp="tpp = 2", tp=3, second="a", kind="parallelsm", cp=3, pp=4,
             lr_key="optimizer.lrr", mem="lots", partition="partion")
FIXED = dict(steps=4, sead="", atol=1e-4, tpp="", tp=2, second="C", kind="parallelism", cp=2, pp=2,
             lr_key="optimizer.lr", mem="8G", partition="partition")


def test_independent_mistakes_are_all_listed_in_one_pass(tmp_path):
    """Table problems, name clashes and the trainer's checks of every set come together, so fixing
    what is listed leaves a valid plan."""
    message = problems(tmp_path, MANY_MISTAKES.format(output=tmp_path / "out", **WRONG))
    listed = [line[4:] for line in message.splitlines()[1:]]
    expected = [
        "plan.sead: unknown key; did you mean 'seed'?",
        "plan.steps: must be >= 1, got 0",
        "tolerance.loss_atol: must be > 0, got -1.0",
        "control.tpp: unknown key; did you mean 'tp'?",
        "sets[1].kind: 'parallelsm' is not one of 'parallelism', 'technique'; did you mean 'parallelism'?",
        "sets[2].overrides.\"optimizer.lrr\": unknown option optimizer.lrr; did you mean 'lr'?",
        "slurm.seed.mem: 'lots' is not a SLURM mem; write it like \"64G\" or \"500M\"",
        "slurm.train.partion: unknown key; did you mean 'partition'?",
        "sets[1] ('a'): name 'a' gives the output folder 'a', as sets[0] ('A') does",
        "sets[0] ('A') (pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=3): parallelism.tensor_parallel_degree=3: the tiny "
        "model's n_heads (4) is not divisible by it",
        "sets[0] ('A') (pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=3): parallelism.tensor_parallel_degree=3: the tiny "
        "model's n_kv_heads (2) is not divisible by it",
        "sets[0] ('A') (pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=3): parallelism.tensor_parallel_degree=3: the tiny "
        "model's vocab_size (256) is not divisible by it",
        "sets[0] ('A') (pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=3): training.seq_len=32: sequence parallelism splits",
        "sets[1] ('a') (pp=1 dp_replicate=1 dp_shard=2 cp=3 tp=1): training.seq_len=32: context_parallel_degree=3",
        "sets[2] ('B') (pp=4 dp_replicate=1 dp_shard=2 cp=1 tp=1): ",
    ]
    assert len(listed) == len(expected), message
    for line, start in zip(listed, expected):
        assert line.startswith(start), (line, start)
    assert "needs 8 stages, but the model has only 4 layers" in listed[-1]
    assert message.splitlines()[0].endswith(f"{len(expected)} problems:")

    fixed = load_plan(write(tmp_path, MANY_MISTAKES.format(output=tmp_path / "out", **FIXED)))
    assert [s.name for s in fixed.sets] == ["A", "C", "B"]


def test_a_set_with_a_problem_of_its_own_is_still_checked_by_the_trainer(tmp_path):
    sets = TP_SET.replace("tp = 2", "tp = 3") + "colour = 1\n"
    message = problems(tmp_path, sets=sets)
    assert "sets[0].colour: unknown key" in message
    assert "parallelism.tensor_parallel_degree=3: the tiny model's n_heads (4)" in message


def test_slurm_options_are_checked(tmp_path):
    text = plan_text(tmp_path) + """
[slurm]
acount = "x"
[slurm.sed]
mem = "1G"
[slurm.seed]
time = "4h"
cpus_per_task = 0
extra = ["--nodes=2", "constraint=h100", "-J name"]
[slurm.train]
extra = "--exclusive"
"""
    message = problems(tmp_path, text)
    for expected in (
            "slurm.acount: unknown key; did you mean 'account'?",
            "slurm.sed: unknown key; did you mean 'seed'?",
            "slurm.seed.time: '4h' is not a SLURM time; write it like \"90\" (minutes), \"4:00:00\" or \"2-00:00:00\"",
            "slurm.seed.cpus_per_task: must be >= 1, got 0",
            "slurm.seed.extra: '--nodes=2' is set by the run's degrees; remove it",
            "slurm.seed.extra: 'constraint=h100' is not an sbatch option; write it as after #SBATCH",
            "slurm.seed.extra: '-J name' is set by the run's name; remove it",
            "slurm.train.extra: expected a list of strings, got '--exclusive'"):
        assert f"  - {expected}" in message, expected
    assert "8 problems" in message


def test_slurm_options_merge_common_and_per_kind(tmp_path):
    text = plan_text(tmp_path) + ('\n[slurm]\naccount = "a"\ntime = "1:00:00"\nextra = ["--x=1"]\n'
                                  '[slurm.train]\ntime = "2-00:00:00"\nextra = ["--y=2"]\n')
    plan = load_plan(write(tmp_path, text))
    seed, control = plan.launches()[:2]
    assert plan.slurm_job(seed).sbatch_options() == ["--account=a", "--time=1:00:00", "--x=1"]
    assert plan.slurm_job(control).sbatch_options() == ["--account=a", "--time=2-00:00:00", "--x=1", "--y=2"]


# ---------------------------------------------------------------------------------------------
# Sweeps

SWEEP = """
[[sweeps]]
name = "{name}"
kind = "technique"
grid = {grid}
overrides = {{ "optimizer.beta1" = 0.8 }}
"""


def test_a_sweep_is_one_set_per_point_of_its_grid_named_after_its_values(tmp_path):
    grid = '{ "optimizer.lr" = [1e-3, 2e-3], "optimizer.weight_decay" = [0.0, 0.1] }'
    plan = load(tmp_path, sets=TP_SET + SWEEP.format(name="opt", grid=grid))
    assert [s.name for s in plan.sets] == ["FSDP+TP2", "opt lr=0.001 weight_decay=0.0", "opt lr=0.001 weight_decay=0.1",
                                           "opt lr=0.002 weight_decay=0.0", "opt lr=0.002 weight_decay=0.1"]
    last = plan.sets[-1]
    assert last.kind == "technique" and last.overrides == {"optimizer.beta1": 0.8, "optimizer.lr": 2e-3,
                                                           "optimizer.weight_decay": 0.1}
    launch = plan.launches()[-1]
    assert arg(launch, "--optimizer.lr") == "0.002" and arg(launch, "--optimizer.weight_decay") == "0.1"
    alone = load(tmp_path, sets=SWEEP.format(name="lr", grid='{ "optimizer.lr" = [1e-3] }'))  # no [[sets]] needed
    assert [s.name for s in alone.sets] == ["lr lr=0.001"]


def test_sweep_mistakes_are_named_once(tmp_path):
    found = problems(tmp_path, sets=SWEEP.format(name="x", grid='{ "optimizer.lr" = 1e-3 }'))
    assert "sweeps[0].grid.optimizer.lr: expected a non-empty array of values, got 0.001" in found
    found = problems(tmp_path, sets=SWEEP.format(name="x", grid='{ "optimizer.lrr" = [1e-3, 2e-3] }'))
    assert '1 problem:\n  - sweeps[0].grid."optimizer.lrr": unknown option optimizer.lrr' in found  # once, not per point
    found = problems(tmp_path, sets=SWEEP.format(name="x", grid="{}"))
    assert "sweeps[0].grid: empty" in found
    assert "a [[sweeps]] table" in problems(tmp_path, sets="")


def test_reduced_sync_tp_plan_validates_at_8_gpus_once_its_data_exists(tmp_path):
    """The GPU plan of the reduced-sync study, with its shards folder made here (a small corpus
    and tokenizer standing in for OpenWebText): every launch passes the trainer's checks."""
    from tests.unit.test_tokenizer import sentences
    from trainer.data.prepare import prepare
    from trainer.data.tokenizer import train_tokenizer

    import json

    lines = sentences(6000, seed=3)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "docs.jsonl").write_text("".join(
        json.dumps({"text": " ".join(lines[i:i + 5])}) + "\n" for i in range(0, len(lines), 5)))
    (tmp_path / "text.txt").write_text("\n".join(lines) + "\n")
    tokenizer = train_tokenizer([str(tmp_path / "text.txt")], str(tmp_path / "tok"), 400)
    prepare([str(tmp_path / "corpus")], tokenizer, str(tmp_path / "shards"), workers=1, validation_fraction=0.2)
    text = (PLANS / "reduced_sync_tp.toml").read_text()
    text = text.replace('"data/openwebtext_shards"', f'"{tmp_path / "shards"}"')
    text = text.replace('"outputs/protocol/reduced_sync_tp"', f'"{tmp_path / "out"}"')
    plan = load_plan(write(tmp_path, text))
    launches = plan.launches()
    # bfloat16 runs are compared statistically: two noise controls of the control
    assert [(l.name, l.nproc, l.nodes) for l in launches[:4]] == [
        ("seed", 1, 1), ("FSDP 2", 2, 1), ("FSDP 2-noise1", 2, 1), ("FSDP 2-noise2", 2, 1)]
    points = [l for l in launches if l.search]
    assert [(l.nproc, l.degrees["tp"], l.degrees["dp_shard"]) for l in points] == [(8, 4, 2)] * 7
    assert [arg(l, "--parallelism.tensor_parallel_sync_group") for l in points] == [
        None, None, "2", "3", "4", "6", "12"]
    for launch in launches[1:]:
        assert (arg(launch, "--model.flavor"), arg(launch, "--training.steps")) == ("125M", "20000")
        assert arg(launch, "--validation.freq") == "500" and "--metrics.count_collectives=true" in launch.args
    assert plan.criterion.describe().startswith("validation/loss at step 20000 <= 3.35")


def test_exact_mode_computes_in_float32_and_refuses_a_lower_precision(tmp_path):
    """Exact mode judges runs that agree to float32 rounding: its runs are pinned to float32 (auto
    would be bfloat16 on a GPU), and a plan asking for bfloat16 or float16 is refused with the key
    and both ways out; statistical mode leaves the precision to the plan."""
    launches = load(tmp_path).launches()
    assert all(arg(l, "--training.mixed_precision_param") == "float32" for l in launches[1:])
    for dtype in ("bfloat16", "float16"):
        extra = f'"training.mixed_precision_param" = "{dtype}", "training.seq_len" = 32 }}'
        message = problems(tmp_path, plan_text(tmp_path).replace('"training.seq_len" = 32 }', extra))
        assert f"training.mixed_precision_param = '{dtype}': [tolerance] mode = \"exact\" needs float32 compute" in message
        assert 'Set mode = "statistical"' in message and "1 problem:" in message
    statistical = load(tmp_path, tolerance='mode = "statistical"').launches()
    assert all(arg(l, "--training.mixed_precision_param") is None for l in statistical[1:])


def test_a_problem_every_run_shares_is_listed_once_with_its_runs(tmp_path):
    text = plan_text(tmp_path).replace('"training.seq_len" = 32 }',
                                       f'"training.seq_len" = 32, "training.dataset" = "shards", '
                                       f'"training.dataset_path" = "{tmp_path / "none"}" }}')
    message = problems(tmp_path, text)
    assert message.count("is not a folder of prepared shards") == 1 and "1 problem:" in message
    assert "control ('control'), sets[0] ('FSDP+TP2'): training.dataset_path:" in message

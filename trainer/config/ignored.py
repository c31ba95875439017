"""torchtitan v0.2.2 configuration sections and keys this trainer accepts without implementing them."""

from __future__ import annotations

# torchtitan sections and keys this trainer does not implement (v0.2.2's, and a few of earlier
# versions). A config that uses them still loads, from the TOML file or the command line alike
# (so upstream configs and launch scripts work as they are), with one warning naming what is
# ignored. A key here that names a table (training.dataloader) covers every key inside it, and
# an ignored section any key inside it.
IGNORED_SECTIONS = frozenset(
    {"fault_tolerance", "quantize", "float8", "mx", "memory_estimation", "experimental"}
)
IGNORED_KEYS = {
    "job": {"custom_config_module", "use_for_integration_test", "print_args"},
    "model": {"converters", "print_after_conversion"},
    "optimizer": {"early_step_in_backward"},
    "training": {"gc_debug", "dataloader"},
    "parallelism": {
        "enable_compiled_autograd",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",  # MoE only: no effect on Llama
        "pipeline_parallel_expert_parallel_overlap",  # MoE only: no effect on Llama
        "module_fqns_per_model_part",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_split_points",
        "context_parallel_load_balancer",
    },
    "checkpoint": {"enable_ft_dataloader_checkpoints", "initial_load_in_hf_quantized"},
    "activation_checkpoint": {
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "visualize_memory_budget_pareto",
    },
    "comm": {"save_traces_folder", "save_traces_file_prefix"},
    "debug": {"moe_force_load_balance"},
    "validation": {"dataloader"},
}


def is_ignored(section: str, key: str = "") -> bool:
    """Whether `section.key` is an ignored option; `key` is dotted below a table
    ("dataloader.num_workers"), empty for the section itself."""
    return section in IGNORED_SECTIONS or key.split(".")[0] in IGNORED_KEYS.get(section, ())

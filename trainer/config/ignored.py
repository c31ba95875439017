"""torchtitan v0.2.2 configuration sections and keys this trainer accepts without implementing them."""

from __future__ import annotations

# torchtitan v0.2.2 sections and keys this trainer does not implement. A config that uses them
# still loads (so upstream configs work as they are), with one warning naming what is ignored.
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
        "module_fqns_per_model_part",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_split_points",
        "context_parallel_load_balancer",
    },
    "checkpoint": {"enable_ft_dataloader_checkpoints", "initial_load_in_hf_quantized"},
    "activation_checkpoint": {
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "memory_budget",
        "visualize_memory_budget_pareto",
    },
    "comm": {"save_traces_folder", "save_traces_file_prefix"},
    "debug": {"moe_force_load_balance"},
}

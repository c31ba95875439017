"""Float8 training of the blocks' linear layers with torchao (model.converters, [quantize.linear.float8]).

The model built on the meta device has its linear layers swapped for torchao's Float8Linear
before any parallelism is applied, so tensor parallelism and FSDP shard float8 layers. A
Float8Linear keeps its weight (same name, same dtype: checkpoints and Hugging Face exports are the
same as without float8) and casts the operands of its three matmuls to float8 with dynamic scales
(absolute maxima of this step), so float8 adds no state to save.

Which layers convert: every linear of the blocks whose dimensions are multiples of 16 (float8
kernels need them), less those filter_fqns names (and, with "auto_filter_small_kn", those torchao
judges too small to gain). The output projection always stays in high precision: its logits
feed the loss directly, and its gradient is the one float8 would hurt most.

torchao is an optional dependency (the float8 extra of pyproject.toml): imported only when float8
is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from dataclasses import dataclass

from trainer.config.quantize import FLOAT8_CONVERTERS

logger = logging.getLogger(__name__)

AUTO_FILTER = "auto_filter_small_kn"  # torchtitan's flag in filter_fqns
ALWAYS_HIGH_PRECISION = "output"


def enabled(config) -> bool:
    return any(name in FLOAT8_CONVERTERS for name in config.model.converters)


@dataclass(frozen=True)
class Float8Conversion:
    """What the conversion did: the float8 layers and those kept in high precision, by name."""

    recipe: str
    converted: tuple[str, ...]
    kept: dict[str, str]  # name -> why it stays in high precision
    fsdp_float8_all_gather: bool
    precompute_scales: bool

    def describe(self) -> str:
        kept = "; ".join(f"{pattern} ({why})" for pattern, why in grouped(self.kept).items())
        return (f"{len(self.converted)} linear layers in float8 ({self.recipe} scaling"
                f"{', float8 all-gather' if self.fsdp_float8_all_gather else ''}): "
                f"{', '.join(name_patterns(self.converted))}; high precision: {kept or 'none'}")

    def record(self) -> dict:
        """The run record's entry (trainer.records.run_meta)."""
        return {"recipe": self.recipe, "converted": len(self.converted), "layers": name_patterns(self.converted),
                "high_precision": grouped(self.kept), "fsdp_float8_all_gather": self.fsdp_float8_all_gather,
                "precompute_scales": self.precompute_scales}


def name_patterns(names) -> list[str]:
    """Layer names with block indices folded: layers.0.attention.wq, layers.1.attention.wq ->
    layers.*.attention.wq (in first-seen order)."""
    return list(dict.fromkeys(re.sub(r"^layers\.\d+\.", "layers.*.", name) for name in names))


def grouped(kept: dict[str, str]) -> dict[str, str]:
    """{layer name pattern: why it stays in high precision} (the first layer's reason)."""
    patterns = {}
    for name, why in kept.items():
        patterns.setdefault(name_patterns([name])[0], why)
    return patterns


def torchao_config(options, recipe: str, all_gather: bool):
    """torchao's Float8LinearConfig for [quantize.linear.float8]."""
    Float8LinearConfig = import_float8().Float8LinearConfig
    if options.recipe_name is not None:
        config = Float8LinearConfig.from_recipe_name(options.recipe_name)
        return dataclasses.replace(config, emulate=True) if options.emulate else config
    return Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=options.emulate)


def why_kept(name: str, module, filter_fqns: list[str], auto_filter) -> str | None:
    """Why the linear layer `name` stays in high precision, or None (it converts)."""
    if name == ALWAYS_HIGH_PRECISION or name.endswith(f".{ALWAYS_HIGH_PRECISION}"):
        return "the output projection, always"
    out_features, in_features = module.weight.shape
    if out_features % 16 or in_features % 16:
        return f"{out_features} x {in_features}, not multiples of 16"
    named = next((fqn for fqn in filter_fqns if fqn in name), None)
    if named is not None:
        return f"filter_fqns {named!r}"
    if auto_filter is not None and not auto_filter(module, name):
        return f"{AUTO_FILTER}: too small to gain"
    return None


def check_kernels(device, emulate: bool) -> None:
    """Float8 matmuls need a GPU of compute capability 8.9 or later (or emulate); CPUs have them."""
    if device.type != "cuda" or emulate:
        return
    import torch

    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        from trainer.config.errors import ConfigError

        raise ConfigError(f"model.converters: float8 matmuls need compute capability 8.9 or later (H100, L4, ...), and "
                          f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; set "
                          "quantize.linear.float8.emulate (slow, for testing) or take float8 out of model.converters")


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX, as torch's cpuinfo sees it (False where torch cannot say)."""
    import torch

    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


def set_onednn(device, float8_on: bool) -> bool:
    """On a CPU with AMX, torch hands float8 matmuls (torch._scaled_mm) to oneDNN, which has no
    float8 matmul kernel and runs its reference one (its verbose log says `ref:any`): 69 ms for a
    256 x 64 x 256 product that float32 computes in 0.24 ms (torch 2.13). With oneDNN off, torch
    computes them as it does on every other CPU: a float32 matmul of the operands times their
    scales. So a float8 run on such a CPU turns oneDNN off, and says so; what else oneDNN would
    compute in its training step (bfloat16 and float16 matmuls) then takes torch's own CPU kernels.
    A setting of the process: set at every build on a CPU (on for a run without float8, torch's
    default), so a run never inherits another's. True where float8's matmuls keep off oneDNN."""
    import torch

    if device.type != "cpu":
        return False
    off = float8_on and cpu_has_amx()
    torch.backends.mkldnn.enabled = not off
    if off:
        logger.info("float8 on a CPU with AMX: oneDNN off for this run (its float8 matmul here is a reference "
                    "kernel, hundreds of times slower than float32); torch computes the float8 matmuls in float32")
    return off


def convert(model, config, fsdp_shards: int, device) -> Float8Conversion:
    """Swap the linear layers of `model` (on the meta device, before any parallelism) for
    float8 ones as the config says. `fsdp_shards`: the ranks FSDP shards over (float8 all-gather
    needs more than one); `device`: where the run computes."""
    options = config.quantize.linear.float8
    check_kernels(device, options.emulate)
    float8 = import_float8()
    recipe = options.recipe_name or "tensorwise"
    all_gather = options.enable_fsdp_float8_all_gather and fsdp_shards > 1 and options.recipe_name is None
    filter_fqns = [fqn for fqn in options.filter_fqns if fqn != AUTO_FILTER]
    auto_filter = None
    if AUTO_FILTER in options.filter_fqns:
        auto_filter = float8._auto_filter_for_recipe(recipe, filter_fqns=[])
    converted, kept = [], {}

    def converts(module, name: str) -> bool:
        reason = why_kept(name, module, filter_fqns, auto_filter)
        if reason is None:
            converted.append(name)
        else:
            kept[name] = reason
        return reason is None

    float8.convert_to_float8_training(model, config=torchao_config(options, recipe, all_gather), module_filter_fn=converts)
    conversion = Float8Conversion(recipe, tuple(converted), kept, all_gather,
                                  all_gather and options.precompute_float8_dynamic_scale_for_fsdp)
    logger.info("float8: %s", conversion.describe())
    if config.model.print_after_conversion:
        logger.info("model after model.converters:\n%s", model)
    return conversion


def precompute_scales(stages, conversion: Float8Conversion | None) -> None:
    """After an optimizer step, with precompute_float8_dynamic_scale_for_fsdp: every float8
    weight's scale for the next all-gather, in one all-reduce per stage."""
    if conversion is None or not conversion.precompute_scales:
        return
    for stage in stages:
        import_float8().precompute_float8_dynamic_scale_for_fsdp(stage)


class _ImportNoise(logging.Filter):
    """What importing torchao logs that says nothing about this run: a warning for each of its
    CUDA kernel libraries a CPU build cannot load and for Triton missing (its int8 kernels need
    it; float8 training here uses neither), and torch's notice that torchao registers an Enum with
    pytree (torchao's to change)."""

    NOISE = ("Failed to load", "Detected no triton", "is an Enum subclass and is now natively supported")
    LOGGERS = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")  # a filter sees its own logger's records

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.NOISE)


@functools.lru_cache(maxsize=None)
def import_float8():
    """torchao.float8, imported without its import noise (_ImportNoise); once per process (each
    step's scale precomputation asks for it)."""
    for name in _ImportNoise.LOGGERS:
        source = logging.getLogger(name)
        if not any(isinstance(f, _ImportNoise) for f in source.filters):
            source.addFilter(_ImportNoise())
    import torchao.float8

    return torchao.float8

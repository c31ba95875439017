"""How the model is cut into pipeline stages, which PP rank runs which stage, and what each
schedule asks of the microbatches. Pure Python: the launcher's preflight (and the convergence
protocol's plan check) validate a layout with it before any process starts.

The model is seen as a row of "virtual layers": `first_less` units standing for the token
embedding, the transformer blocks, then `last_less` units standing for the final norm and output
projection. Stages take contiguous, near-equal slices of that row, so the first and last stages
get fewer blocks to make up for the embedding and the output (which cost about a layer each).
"""

from __future__ import annotations

from dataclasses import dataclass

# One stage per PP rank.
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# Several stages per PP rank, stage s on rank s % pp ("loop" placement).
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
# Exactly two stages per PP rank, rank r holding stages r and 2*pp-1-r ("V" placement).
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES
# Schedules that split backward into input- and weight-gradient passes; torch.compile cannot.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


class StageError(ValueError):
    """A pipeline layout that cannot work; the message names the key to change."""


@dataclass(frozen=True)
class StagePlan:
    schedule: str
    pp: int
    blocks: tuple[tuple[int, ...], ...]  # transformer block indices of each stage

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    def rank_of_stage(self, stage: int) -> int:
        if self.schedule in V_SCHEDULES:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of_stage(s) == pp_rank]

    def describe(self) -> str:
        parts = []
        for s, blocks in enumerate(self.blocks):
            names = (["embedding"] if s == 0 else []) + [f"layer {b}" for b in blocks] + (
                ["output"] if s == self.num_stages - 1 else [])
            parts.append(f"stage {s} (pp rank {self.rank_of_stage(s)}): {', '.join(names)}")
        return "; ".join(parts)


def plan_stages(n_layers: int, pp: int, schedule: str, layers_per_stage: int | None,
                first_less: int, last_less: int, parts: list[list[str]] | None = None) -> StagePlan:
    """Split n_layers blocks into stages for `pp` ranks and the given schedule (as `parts`, the
    modules of each stage, says when given)."""
    if schedule not in SCHEDULES:
        raise StageError(f"parallelism.pipeline_parallel_schedule: unknown schedule {schedule!r}; "
                         f"choose one of {', '.join(SCHEDULES)}")
    if parts is not None:
        if layers_per_stage is not None:
            raise StageError("parallelism.module_fqns_per_model_part: gives the split itself; unset "
                             "pipeline_parallel_layers_per_stage")
        plan = StagePlan(schedule, pp, stages_of_parts(parts, n_layers))
        check_part_count(plan.num_stages, pp, schedule)
        return plan
    for key, value in (("first_stage_less_layers", first_less), ("last_stage_less_layers", last_less)):
        if value < 0:
            raise StageError(f"parallelism.pipeline_parallel_{key}: must be >= 0, got {value}")
    virtual = first_less + n_layers + last_less
    if layers_per_stage is None:
        num_stages = pp * stages_per_rank_default(schedule)
        sizes = even_split(virtual, num_stages)
    else:
        if layers_per_stage < 1:
            raise StageError(f"parallelism.pipeline_parallel_layers_per_stage: must be >= 1, got {layers_per_stage}")
        num_stages = -(-virtual // layers_per_stage)
        sizes = [layers_per_stage] * (num_stages - 1) + [virtual - layers_per_stage * (num_stages - 1)]
    check_stage_count(num_stages, pp, schedule, layers_per_stage, n_layers, first_less, last_less)
    blocks, start = [], 0
    for s, size in enumerate(sizes):
        layer_range = range(max(start - first_less, 0), min(start + size - first_less, n_layers))
        blocks.append(tuple(layer_range))
        if not layer_range and 0 < s < num_stages - 1:
            raise StageError(
                f"pipeline stage {s} of {num_stages} would hold no layers ({n_layers} layers, the embedding counted "
                f"as {first_less} and the output as {last_less}); lower parallelism.pipeline_parallel_first_stage_"
                "less_layers / last_stage_less_layers, or use fewer stages")
        start += size
    return StagePlan(schedule, pp, tuple(blocks))


PARTS_KEY = "parallelism.module_fqns_per_model_part"


def stages_of_parts(parts: list[list[str]], n_layers: int) -> tuple[tuple[int, ...], ...]:
    """The blocks of each stage of a split given by module names, or StageError naming what is
    wrong: every block once and in order, the embedding first, the final norm and output last."""
    last = len(parts) - 1
    blocks, seen = [], []
    for index, part in enumerate(parts):
        expected_ends = ({"tok_embeddings"} if index == 0 else set()) | ({"norm", "output"} if index == last else set())
        ends = {name for name in part if name in ("tok_embeddings", "norm", "output")}
        if ends != expected_ends:
            raise StageError(f"{PARTS_KEY}: part {index} holds {sorted(ends) or 'none'} of tok_embeddings, norm and "
                             f"output; the first part takes tok_embeddings, the last norm and output")
        layers = [name for name in part if name not in ends]
        wrong = [name for name in layers if not (name.startswith("layers.") and name[7:].isdigit()
                                                 and int(name[7:]) < n_layers)]
        if wrong:
            raise StageError(f"{PARTS_KEY}: {wrong[0]!r} in part {index} is not a module of the model; name "
                             f"tok_embeddings, layers.0 to layers.{n_layers - 1}, norm and output")
        if not layers and 0 < index < last:
            raise StageError(f"{PARTS_KEY}: part {index} holds no layer")
        blocks.append(tuple(int(name[7:]) for name in layers))
        seen += blocks[-1]
    if seen != list(range(n_layers)):
        raise StageError(f"{PARTS_KEY}: the parts must hold layers.0 to layers.{n_layers - 1} once each and in order; "
                         f"they hold {', '.join(map(str, seen)) or 'none'}")
    return tuple(blocks)


def check_part_count(num_stages: int, pp: int, schedule: str) -> None:
    """A split's number of stages against what the schedule runs on `pp` ranks."""
    if schedule_takes(num_stages, pp, schedule):
        return
    need = (f"exactly {pp} stages (one per PP rank)" if schedule in SINGLE_STAGE_SCHEDULES else
            f"exactly {2 * pp} stages (two per PP rank)" if schedule in V_SCHEDULES else
            f"a multiple of {pp} stages, at least {2 * pp}")
    raise StageError(f"{PARTS_KEY}: {num_stages} parts, but {schedule} on {pp} PP ranks runs {need}")


def stages_per_rank_default(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def even_split(total: int, parts: int) -> list[int]:
    """`parts` sizes summing to `total`, differing by at most one, the larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def check_stage_count(num_stages: int, pp: int, schedule: str, layers_per_stage: int | None, n_layers: int,
                      first_less: int, last_less: int) -> None:
    virtual = first_less + n_layers + last_less
    if num_stages > virtual:
        raise StageError(
            f"parallelism.pipeline_parallel_degree={pp} with {schedule} needs {num_stages} stages, but the model has "
            f"only {n_layers} layers (+{first_less} for the embedding, +{last_less} for the output); use a smaller "
            "pipeline degree, a single-stage schedule (1F1B, GPipe), or a deeper model")
    if schedule_takes(num_stages, pp, schedule):
        return
    per_stage = f"pipeline_parallel_layers_per_stage={layers_per_stage} gives {num_stages} stages"
    if schedule in SINGLE_STAGE_SCHEDULES:
        raise StageError(f"parallelism.{per_stage}, but {schedule} runs exactly one stage per PP rank "
                         f"({pp}); set it to {-(-virtual // pp)} or leave it unset")
    if num_stages % pp or num_stages // pp < 2:
        raise StageError(f"parallelism.{per_stage}, but {schedule} needs a multiple of {pp} stages, "
                         f"at least 2 per PP rank; leave it unset for {2 * pp} stages")
    raise StageError(f"parallelism.{per_stage}, but {schedule} runs exactly 2 stages per PP rank "
                     f"({2 * pp} stages); leave it unset")


def schedule_takes(num_stages: int, pp: int, schedule: str) -> bool:
    """Whether `schedule` runs `num_stages` stages on `pp` ranks: one per rank, exactly two (the V
    schedules), or a multiple of the ranks, at least two each (the looped ones)."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return num_stages == pp
    if schedule in V_SCHEDULES:
        return num_stages == 2 * pp
    return num_stages % pp == 0 and num_stages // pp >= 2


def accumulation_steps(global_batch_size: int, local_batch_size: int, dp: int) -> int:
    """Local batches per data-parallel rank and optimizer step (global_batch_size -1: one). A global
    batch that is not a multiple of local x dp is the preflight's to refuse; it counts as one here."""
    per_pass = local_batch_size * dp
    if global_batch_size <= 0 or per_pass <= 0 or global_batch_size % per_pass:
        return 1
    return global_batch_size // per_pass


def check_microbatches(schedule: str, local_batch_size: int, microbatch_size: int, pp: int, num_stages: int,
                       accumulation_steps: int = 1) -> int:
    """The number of pipeline microbatches of one optimizer step, or StageError naming the fix.

    Each local batch is cut into pipeline microbatches, and the local batches of all accumulation
    steps go through the pipeline in one schedule step, so what the schedule must accept is
    local_batch_size / microbatch_size x accumulation_steps microbatches."""
    if microbatch_size < 1 or local_batch_size % microbatch_size:
        raise StageError(
            f"training.local_batch_size={local_batch_size} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size={microbatch_size}")
    n = local_batch_size // microbatch_size * accumulation_steps
    gives = (f"training.local_batch_size={local_batch_size} / pipeline_parallel_microbatch_size={microbatch_size}"
             + (f" x {accumulation_steps} accumulation steps" if accumulation_steps > 1 else "") + f" gives {n}")
    need = {"1F1B": pp, "Interleaved1F1B": pp, "InterleavedZeroBubble": pp,
            "ZBVZeroBubble": num_stages, "DualPipeV": num_stages}.get(schedule, 1)
    if n < need:
        local_needed = -(-need // accumulation_steps) * microbatch_size
        raise StageError(
            f"{schedule} with {pp} PP ranks and {num_stages} stages needs at least {need} microbatches, but "
            f"{gives}; raise the local batch size to {local_needed} or lower the microbatch size")
    rounds = max(1, n // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and n % rounds:
        raise StageError(
            f"{schedule} runs the microbatches in {rounds} equal rounds ({n} // PP degree {pp}), but "
            f"{gives}; use a multiple of {pp} microbatches")
    return n

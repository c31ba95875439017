"""The job configuration: one dataclass per TOML section ([metrics] and [profiling] live in
trainer/config/observability.py, [activation_checkpoint] and [compile] in trainer/config/compute.py,
[validation] in trainer/config/validation.py).

Section and key names follow the torchtitan v0.2.2 TOML format so that its configs load here.
Every field carries a docstring (the string literal right below it), and every number declares
the values it accepts (`valid(default, ...)`, trainer/config/ranges.py); `--help` and
docs/configuration.md are generated from both, so they are the reference.

This module imports nothing heavy: the launcher validates a config before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from trainer.config.checkpointing import Checkpoint
from trainer.config.compute import ActivationCheckpoint, Compile
from trainer.config.dataloader import DataLoader
from trainer.config.observability import MemoryEstimation, Metrics, Profiling
from trainer.config.quantize import Quantize
from trainer.config.ranges import SEED_MAX, DType, valid
from trainer.config.validation import Validation

EXACT_UNSCALING = "so that unscaling is exact, e.g. 65536 or 1"


@dataclass
class Job:
    """Where the configuration comes from and where the run writes."""

    config_file: str = ""
    """TOML file to load. A bare name is looked up in the working directory, then in train_configs/."""

    dump_folder: str = "./outputs"
    """Folder for everything the run writes: metrics.jsonl, TensorBoard events, checkpoints."""

    description: str = ""
    """Free text describing the job; logged at start."""

    print_config: bool = False
    """Print the resolved configuration as TOML and exit without training."""

    save_config_file: Optional[str] = None
    """A file name in job.dump_folder: a training run's rank 0 writes the resolved configuration
    there as TOML (what job.print_config prints, loadable with --job.config_file) at every start,
    a resume included. The dump folder is the run's own, so the file is replaced at each start,
    but only when this trainer wrote it: a file it did not write is never overwritten (refused
    before launch). Must stay inside job.dump_folder (no absolute path, no '..'). Unset: none."""


@dataclass
class Model:
    """Which model to build."""

    name: Literal["llama3"] = "llama3"
    """Model family."""

    flavor: str = "debugmodel"
    """Size preset of the model family: tiny, debugmodel, 125M, 1B, 3B, 8B, 70B or 405B (1B and 3B
    are Llama 3.2's, with the output layer tied to the token embedding), or "hf": the shapes of
    the config.json in model.hf_assets_path (any Llama-architecture checkpoint)."""

    tokenizer_path: str = ""
    """Tokenizer file: a Hugging Face tokenizer.json, a tiktoken BPE ranks file (Llama 3's
    original tokenizer.model) or a SentencePiece .model; the kind is read from the file. Empty:
    the tokenizer of model.hf_assets_path when set, else the data source's own token ids
    (built-in sources)."""

    hf_assets_path: str = ""
    """A local folder of Hugging Face assets (as a model hub download holds them): its tokenizer
    (tokenizer.json, else tokenizer.model) is used when model.tokenizer_path is empty, and its
    config.json gives the shapes when model.flavor is "hf". Nothing is downloaded."""

    converters: list[Literal["quantize.linear.float8", "float8"]] = field(default_factory=list)
    """Conversions of the built model: "quantize.linear.float8" (or torchtitan's earlier name
    "float8") trains the blocks' linear layers in float8, as [quantize.linear.float8] says
    (needs torchao: pip install -e '.[float8]'). Empty: none."""

    print_after_conversion: bool = False
    """Log the model's modules after model.converters converted them (rank 0)."""


@dataclass
class Optimizer:
    """The optimizer."""

    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""

    lr: float = valid(8e-4, ge=0, float32=True, note="0 keeps the weights as they are")
    """Peak learning rate, reached at the end of warmup."""

    beta1: float = valid(0.9, ge=0, lt=1)
    """Adam first-moment decay."""

    beta2: float = valid(0.95, ge=0, lt=1)
    """Adam second-moment decay."""

    eps: float = valid(1e-8, gt=0, float32=True)
    """Adam epsilon, added to the denominator."""

    weight_decay: float = valid(0.1, ge=0, float32=True)
    """Decoupled weight decay (AdamW); L2 penalty for Adam."""

    weight_decay_exclude: list[Literal["norm", "embedding", "output", "bias"]] = field(default_factory=list)
    """Parameter kinds trained without weight decay: norm (RMSNorm gains), embedding (token
    embedding), output (final projection), bias. Empty: every parameter decays."""

    implementation: Literal["for-loop", "foreach", "fused"] = "foreach"
    """Kernel strategy of the torch optimizer: one kernel per tensor, grouped, or fused."""


@dataclass
class LRScheduler:
    """Learning-rate schedule: linear warmup, an optional stable phase, then decay."""

    warmup_steps: int = valid(200, ge=0)
    """Steps of linear warmup from lr/warmup_steps to lr. Longer than the schedule (total_steps,
    else training.steps): the peak is never reached."""

    total_steps: Optional[int] = valid(None, ge=1, also=((None, "the schedule spans training.steps"),))
    """Steps of the schedule, when they differ from training.steps: warmup, stable phase and decay
    are laid out over this many steps, whatever training.steps is, and steps past it train at
    lr x min_lr_factor. A run that sets it can be stopped early and later extended (raising
    training.steps, up to total_steps) on exactly the learning rates of one long run. Unset:
    training.steps."""

    decay_ratio: Optional[float] = valid(
        None, ge=0, le=1, note="the share of the steps after warmup spent decaying; 0 keeps the peak learning rate",
        also=((None, "decay over all of them"),))
    """Fraction of the post-warmup steps spent decaying; the rest is a stable phase at peak lr.
    Unset: decay over all steps after warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay from lr to lr * min_lr_factor."""

    min_lr_factor: float = valid(0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


@dataclass
class MixtureSource:
    """One source of a weighted mixture: a [[training.datasets]] table."""

    dataset: Literal["shards", "files"] = "shards"
    """Kind of source, as training.dataset: 'shards' (a prepared folder) or 'files'."""

    path: str = ""
    """Its location, as training.dataset_path."""

    weight: float = valid(1.0, gt=0)
    """Share of the training sequences drawn from it, relative to the other sources' weights."""

    name: str = ""
    """Label in metrics (data/<name>_tokens). Empty: the last part of the path."""


@dataclass
class Training:
    """Data, batch shape, steps and numerics of the training loop."""

    dataset: str = "synthetic"
    """Data source: 'synthetic' (built in: a random Markov chain with a known best loss),
    'synthetic_context' (built in: markers at fixed positions and copies at a fixed distance between
    steps of a Markov chain, so that attention and positions matter; known best loss),
    'python_stdlib' (built in, real text: the installed Python's standard library, its language
    reference and top-level modules, about 5 MB; prepared once into token shards in a cache
    folder, $TRAINER_CACHE_DIR or ~/.cache/llama_pretrain, with a byte-level BPE of
    min(vocabulary, 8192) pieces trained on it, or with the job's tokenizer when
    model.tokenizer_path or model.hf_assets_path names one), 'shards'
    (a folder of token shards written by `python -m trainer.data.prepare`, read from disk as needed: the
    format for real corpora), 'files' (local .jsonl/.json/.parquet/.txt at dataset_path,
    tokenized into memory at every start: small corpora), 'c4_test' (torchtitan's name for its
    small sample of C4: read as 'files' from dataset_path), or a Hugging Face dataset streamed by
    name ('c4', 'c4_validation' = C4's validation split, 'fineweb', 'fineweb-edu' or a hub id
    'org/name')."""

    dataset_path: str = ""
    """'shards': the prepared folder. 'files' and 'c4_test' (required): a file, folder or glob.
    Hugging Face datasets: a local copy (a folder of data files named by split, as on the hub)
    loaded instead of the hub; without one and without hub access (HF_HUB_OFFLINE=1, or no
    network), a run is refused at start unless the Hugging Face cache holds the dataset.
    Refused with the built-in 'synthetic', 'synthetic_context' and 'python_stdlib'."""

    dataset_text_field: str = "text"
    """Field holding the document text in .jsonl/.json/.parquet records and Hugging Face datasets."""

    dataset_end: Literal["wrap", "stop"] = "wrap"
    """At the end of a finite dataset: start the next epoch (logged), or stop training cleanly."""

    datasets: list[MixtureSource] = field(default_factory=list)
    """A weighted mixture of sources instead of training.dataset: [[training.datasets]] tables
    (dataset, path, weight, name), set in the TOML file. Every block of 10,000 sequences takes
    each source's share of it, interleaved so that every global batch holds each share to within
    one sequence; each source goes through its own (shuffled) epochs, so a small source with a
    large weight repeats. Validation reads the same mixture of the sources' validation splits."""

    document_masking: bool = False
    """Keep each document to itself: attention sees only earlier tokens of the same document, and
    the token after each EOS (the next document's first) is not a prediction target. false: plain
    packing, attention across the documents of a sequence and the EOS -> BOS transition trained.
    Needs a source made of documents (not 'synthetic'); not available with pipeline parallelism."""

    document_masking_kernel: Literal["mask", "flex"] = "mask"
    """How document-masked attention is computed: 'mask', SDPA with an explicit (T x T) mask,
    which rules out flash kernels and computes every block; 'flex', torch's flex attention with a
    document block mask, which skips the blocks no query of a document sees (CUDA only: torch's
    flex attention has no backward on a CPU). Under context parallelism only 'mask' is taken: the
    ring attention skips such blocks itself and masks the others a tile of query rows at a time."""

    shuffle: bool = True
    """Read every epoch in a new order, a seeded permutation of (data seed, epoch) that is the
    same in every parallel layout: the sequences of 'files' and 'shards'; the order of each
    lane's data files for streamed datasets (documents within a file stay in file order).
    false: in file order, every epoch alike."""

    stream_lanes: int = valid(1, ge=1)
    """Streamed datasets: the number of lanes, independent streams over disjoint sets of the
    dataset's data files (file i in lane i mod lanes). Lane j fills rows [j*G/lanes,
    (j+1)*G/lanes) of every global batch of G rows, so each data-parallel rank reads and
    tokenizes only the lanes of its own rows: a multiple of the data-parallel degree shares the
    work evenly (1: every rank reads the whole stream). Must divide the global batch size, be at
    most the number of data files, and stay the same for a whole run (it decides the rows)."""

    stream_workers: int = valid(1, ge=0)
    """Streamed datasets: tokenizer processes per lane (each rank runs them for its own lanes),
    fed by a reading thread. 0: tokenize in the training process, as rows are needed."""

    stream_prefetch: int = valid(4, ge=1)
    """Streamed datasets: chunks (~256 KB of text each) per lane held tokenized ahead of use."""

    dataloader: DataLoader = field(default_factory=DataLoader)
    """[training.dataloader]: worker processes reading the coming batches ahead."""

    data_seed: Optional[int] = valid(None, ge=0, le=SEED_MAX)
    """Seed of the data: the shuffled order of files and shards, and the synthetic source's chain
    and walks. Unset: debug.seed."""

    validation_fraction: Optional[float] = valid(None, ge=0, lt=1)
    """'files' and 'python_stdlib': share of documents held out as the validation split, chosen by
    a hash of each document's text, whether validation is enabled or not (so training reads the
    same documents either way, and adding files never moves a document between splits). Unset:
    0.05. 'shards':
    fixed when the folder was prepared (--validation-fraction); a different value here is an error."""

    local_batch_size: int = valid(8, ge=1)
    """Sequences per data-parallel rank per forward/backward pass (microbatch of gradient accumulation)."""

    global_batch_size: int = valid(-1, ge=1, also=((-1, "local_batch_size x data-parallel degree"),))
    """Sequences per optimizer step over all ranks. -1: local_batch_size x data-parallel degree.
    Larger values accumulate gradients over several local batches."""

    seq_len: int = valid(2048, ge=2)
    """Tokens per sequence."""

    max_norm: float = valid(1.0, note="<= 0 turns clipping off")
    """Clip the global gradient norm to this value. <= 0 disables clipping (the norm is still logged)."""

    steps: int = valid(10000, ge=1)
    """Optimizer steps to train."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the parameters are stored and trained in. bfloat16: full bfloat16 training, with
    parameters, gradients and optimizer state all in bfloat16 and no float32 master copy (half the
    memory of float32 state; updates smaller than bfloat16's resolution of a weight are lost).
    The initial weights are drawn in float32 and rounded; RMSNorm statistics, rotary embeddings,
    the loss and the gradient norm stay in float32, and gradient reductions run in
    mixed_precision_reduce. mixed_precision_param must then be auto or bfloat16 (nothing is cast
    up for compute), and debug.init_perturbation 0."""

    mixed_precision_param: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype FSDP casts parameters to for compute. auto: bfloat16 on CUDA, float32 on CPU, and
    bfloat16 with training.dtype = "bfloat16" (the resolved configuration then says bfloat16)."""

    mixed_precision_reduce: DType = "float32"
    """Dtype of every gradient reduction: FSDP's reduce-scatter and all-reduce, the TP all-reduce
    of the norm weights' gradients and the CP reduce-scatter of key/value gradients."""

    loss_scale_initial: float = valid(65536.0, power_of_two=True, note=EXACT_UNSCALING)
    """float16 compute only (mixed_precision_param = "float16"): the first dynamic loss scale, a
    power of two. The loss is multiplied by the scale before backward so that small gradients
    do not flush to zero in float16; a step whose gradients overflow is skipped and halves it."""

    loss_scale_growth_interval: int = valid(1000, ge=1)
    """float16 only: double the loss scale after this many steps in a row without an overflow."""

    loss_scale_min: float = valid(1.0, power_of_two=True, note=EXACT_UNSCALING)
    """float16 only: the smallest loss scale, a power of two; an overflow at this scale stops the
    run as a diverged loss."""

    enable_cpu_offload: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state in CPU memory."""

    gc_freq: int = valid(50, ge=1)
    """Run Python's garbage collector every this many steps (automatic collection is disabled
    during training so that all ranks pause together)."""


@dataclass
class Parallelism:
    """Parallel degrees and their options. The product of the degrees must equal the world size."""

    data_parallel_replicate_degree: int = valid(1, ge=1)
    """Replicas of the model. With data_parallel_shard_degree = 1 (and no context parallelism)
    this is DDP; with shard degree > 1 it is HSDP (sharded within, replicated across groups)."""

    data_parallel_shard_degree: int = valid(-1, ge=1, also=((-1, "the rest of the world"),))
    """FSDP shard group size. -1: whatever the other degrees leave of the world size."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free unsharded parameters after forward (ZeRO-3-like) or keep them to backward (ZeRO-2-like).
    default: always, except never under pipeline parallelism, where a stage otherwise gathers its
    weights again for every microbatch's backward (docs/parallelisms.md: the trade-off measured)."""

    tensor_parallel_degree: int = valid(1, ge=1)
    """Tensor parallel degree, with sequence parallelism for norms and the residual stream. Must
    divide the model's heads, KV heads and vocabulary, and seq_len / context_parallel_degree."""

    disable_loss_parallel: bool = False
    """Under tensor parallelism, gather the vocabulary-sharded logits before the loss instead of
    computing the cross-entropy on the shards."""

    tensor_parallel_sync: Literal["full", "per_block", "grouped"] = "full"
    """Where the tensor-parallel ranks synchronize the residual stream (docs/parallelisms.md).
    full: after attention and after the FFN of every block (2 per block, exact tensor parallelism).
    per_block: once per block; the FFN sees the block input plus this rank's partial attention
    output. grouped: once per tensor_parallel_sync_group blocks, each rank carrying its own partial
    residual in between. The reduced variants change the model (a technique, not a layout) and
    need tensor_parallel_degree > 1."""

    tensor_parallel_sync_group: int = valid(0, ge=0)
    """Blocks per synchronization with tensor_parallel_sync = "grouped" (1 is per_block's model);
    0 (unset) otherwise. Under pipeline parallelism a group may not span two stages."""

    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with the neighbouring matmuls (a compiler pass: needs
    compile.enable and CUDA)."""

    pipeline_parallel_degree: int = valid(1, ge=1)
    """Ranks along the pipeline; each runs one or more stages (see pipeline_parallel_schedule)."""

    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """Pipeline schedule from torch.distributed.pipelining. GPipe and 1F1B run one stage per PP rank;
    Interleaved1F1B, LoopedBFS and InterleavedZeroBubble two or more (stage s on rank s % degree);
    ZBVZeroBubble and DualPipeV exactly two, in a V (rank r runs stages r and 2 x degree - 1 - r)."""

    pipeline_parallel_layers_per_stage: Optional[int] = valid(None, ge=1)
    """Layers per pipeline stage, the embedding and the output counted as first/last_stage_less_layers
    layers; sets the number of stages. Unset: one stage per PP rank (two for multi-stage schedules)."""

    module_fqns_per_model_part: Optional[list[list[str]]] = None
    """One's own pipeline split: the modules of each stage, in order, e.g.
    [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]:
    every block (layers.<i>) once and in order, tok_embeddings in the first stage, norm and output
    in the last; the number of stages must suit the schedule. On the command line as JSON. Unset:
    the split of pipeline_parallel_layers_per_stage / first and last_stage_less_layers."""

    pipeline_parallel_first_stage_less_layers: int = valid(1, ge=0)
    """Layers fewer on the first stage, to make room for the token embedding."""

    pipeline_parallel_last_stage_less_layers: int = valid(1, ge=0)
    """Layers fewer on the last stage, to make room for the output projection and loss."""

    pipeline_parallel_microbatch_size: int = valid(1, ge=1)
    """Sequences per pipeline microbatch; local_batch_size must be a multiple. The microbatches of
    all gradient-accumulation steps run in one schedule step: 1F1B and the interleaved schedules
    need at least pipeline_parallel_degree of them per step, the V schedules at least 2 x
    pipeline_parallel_degree."""

    context_parallel_degree: int = valid(1, ge=1)
    """Context parallel degree: each rank holds 1/degree of every sequence (two chunks of
    2 x degree, head and tail, for an even causal workload). seq_len must be a multiple of 2 x degree."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """torchtitan's choice of how context-parallel ranks exchange keys and values. Here they always
    pass around the CP ranks as a ring, one point-to-point hop per step (on any backend; see
    docs/parallelisms.md); 'allgather', the default, is accepted and runs that ring; 'alltoall' is
    refused, whatever the degree."""


@dataclass
class Comm:
    """Collective communication."""

    init_timeout_seconds: int = valid(300, ge=1, note="seconds")
    """Timeout for process-group creation and the first collectives."""

    train_timeout_seconds: int = valid(100, ge=1, note="seconds")
    """Timeout for collectives once the first step has run, on every process group (mesh
    subgroups included); synchronous checkpoint saves after that step run under it too,
    asynchronous ones keep init_timeout_seconds."""

    trace_buf_size: int = valid(20000, ge=0, note="0 disables it")
    """Entries of the NCCL flight recorder (CUDA only); 0 disables it. While it records, a
    collective that times out makes every rank dump its recent collectives to
    save_traces_folder."""

    save_traces_folder: str = "comm_traces"
    """Folder in job.dump_folder for the flight recorder's dumps (CUDA, trace_buf_size > 0): one file
    per rank, read with `python -m torch.distributed.flight_recorder.fr_trace FOLDER`, which names
    the collective each rank was in when a job hung."""

    save_traces_file_prefix: str = "rank_"
    """Beginning of the flight recorder's file names (the rank follows)."""


@dataclass
class Debug:
    """Reproducibility, and a slow job for rehearsals."""

    seed: int = valid(0, ge=0, le=SEED_MAX)
    """Seed of the initial weights, and of the data unless training.data_seed is set."""

    deterministic: bool = False
    """Use deterministic algorithms only (slower); required for bitwise-reproducible runs."""

    deterministic_warn_only: bool = False
    """With deterministic: warn instead of failing on an op without a deterministic implementation."""

    init_perturbation: float = valid(0.0, ge=0, le=64, note="rounding errors of the compute dtype; 0 is off")
    """Multiply every initial weight matrix by (1 + x), x uniform in +-init_perturbation rounding
    errors of the compute dtype (half its machine epsilon: 2^-8 for bfloat16, 2^-24 for float32),
    drawn from (init_perturbation_seed, parameter name), so the same in every layout; norm gains
    stay as they are (trainer/model_build.py). Applied once, to the weights a new run starts from
    (initialized or loaded from checkpoint.initial_load_path), never on resume. 0: off. The
    convergence protocol's noise controls use 1: runs that differ from the control only in
    rounding, not in data or initial weights."""

    init_perturbation_seed: int = valid(1, ge=0)
    """Seed of init_perturbation's noise; each noise control of the protocol uses its own."""

    step_delay_s: float = valid(0.0, ge=0, le=3600, note="0 is off")
    """Seconds every rank waits after each training step (not after the last): a slow job that
    computes little, to rehearse a cluster's time limits, signals and requeues, or the launcher's
    restarts, without spending the compute. The numbers are those of the same run without it; the
    wait stays out of tokens_per_s and step_time_s. 0: off."""


@dataclass
class JobConfig:
    """The whole configuration. Section names are the TOML table names."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    debug: Debug = field(default_factory=Debug)
    validation: Validation = field(default_factory=Validation)

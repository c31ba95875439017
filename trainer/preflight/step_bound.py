"""A lower bound of one training step's activation memory per rank, from the shapes alone (in
microseconds, before any process starts): what the forward must keep for backward.

Per token of a block, backward needs at least: the two norms' outputs (the linear layers' input),
q, k and v, the attention output, and the FFN's w1 and w3 outputs, their gated product and the
SiLU of w1 (each in the compute dtype); the kernels' own extras (softmax statistics, RMSNorm's
float32 input, a mask) are left out. Tensor parallelism splits the heads and FFN units over its
ranks (and the vocabulary under loss parallelism), context parallelism the tokens. Under
activation checkpointing only each block's input is kept, plus one block's activations while it
recomputes. The output layer adds the logits and the loss's float32 log-probabilities. Under
pipeline parallelism, where the stages split the blocks as the schedule or the user says, only the
last stage's logits of one microbatch are counted.

A step whose bound exceeds the memory there is cannot fit; a step under it may still not (this is
0.6 to 0.8 of the step peak `python -m trainer.estimate` counts with the weights, measured on the
debug model in tests/integration/test_step_bound.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.job_config import JobConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOSS_BYTES = 4  # the loss's float32 log-probabilities
# Adam: the parameter, its gradient, exp_avg and exp_avg_sq, each of training.dtype.
TENSORS_PER_PARAMETER = 4


@dataclass(frozen=True)
class ActivationBound:
    """Bytes per rank: `per_token` for each token of one microbatch on this rank, and the
    microbatch's tokens on it."""

    per_token: int
    tokens: int

    @property
    def bytes(self) -> int:
        return self.per_token * self.tokens

    def seq_len_limit(self, room: int, seq_len: int, where: str = "") -> str:
        """" (above N tokens ...)": the longest sequence whose bound fits `room` bytes per rank,
        when it is shorter than `seq_len` (and any fits); "" otherwise."""
        longest = max(0, room) * seq_len // max(1, self.bytes)
        return f" (above {longest:,} tokens no step of this batch fits{where})" if 0 < longest < seq_len else ""


def state_bytes_per_parameter(config: JobConfig) -> int:
    """Weights, gradients and Adam's two moments, in training.dtype."""
    return TENSORS_PER_PARAMETER * DTYPE_BYTES[config.training.dtype]


def compute_bytes(config: JobConfig, device_type: str) -> int:
    """Bytes of the compute dtype ('auto': bfloat16 on CUDA, float32 on a CPU, as trainer/parallel/fsdp.py)."""
    name = config.training.mixed_precision_param
    if config.training.dtype == "bfloat16":
        return 2
    if name == "auto":
        return 2 if device_type == "cuda" else 4
    return DTYPE_BYTES[name]


def block_bytes_per_token(args, tp: int, dtype_bytes: int) -> int:
    """What one block keeps for backward per token, at least (module docstring)."""
    attention = (args.n_heads + 2 * args.kv_heads) * args.head_dim + args.n_heads * args.head_dim
    ffn = 4 * args.ffn_hidden_dim
    return dtype_bytes * (2 * args.dim + (attention + ffn) // tp)


def activation_bound(config: JobConfig, tp: int, cp: int, pp: int, device_type: str) -> ActivationBound:
    """A lower bound for every rank (under pipeline parallelism, the last stage's logits alone)."""
    from trainer.models.llama3.hf_config import configured_model_args

    args = configured_model_args(config.model)
    dtype_bytes = compute_bytes(config, device_type)
    p = config.parallelism
    sequences = p.pipeline_parallel_microbatch_size if pp > 1 else config.training.local_batch_size
    tokens = sequences * config.training.seq_len // cp
    vocab = args.vocab_size // (tp if not p.disable_loss_parallel else 1)
    logits = vocab * (dtype_bytes + LOSS_BYTES)
    if pp > 1:  # stages split the blocks as a schedule or the user says: the last stage's logits, at least
        return ActivationBound(per_token=logits, tokens=tokens)
    block = block_bytes_per_token(args, tp, dtype_bytes)
    recomputed = recomputed_blocks(config.activation_checkpoint, args.n_layers)
    # A recomputed block keeps its input, and recomputes one block at a time.
    kept = (args.n_layers - recomputed) * block + recomputed * dtype_bytes * args.dim + (block if recomputed else 0)
    return ActivationBound(per_token=kept + logits, tokens=tokens)


def recomputed_blocks(ac, n_layers: int) -> int:
    """Blocks whose activations are recomputed in backward, at most (trainer/parallel/activation_checkpointing.py:
    selective layer checkpointing recomputes every N-th block; its op option and the compiler's
    memory budget keep more than the block input, counted as full checkpointing)."""
    if ac.mode == "none":
        return 0
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        return len(range(0, n_layers, int(ac.selective_ac_option)))
    return n_layers


def gpu_memory() -> int | None:
    """Bytes of the smallest GPU of this machine, from nvidia-smi (no CUDA context in the launcher,
    whose ranks start after it); None without it."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
        sizes = [int(line) * 2 ** 20 for line in done.stdout.split()] if done.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return min(sizes) if sizes else None


def check_device_memory(config: JobConfig, dims, device_memory: int | None) -> None:
    """ConfigError when one rank's step cannot fit its GPU: its share of the model state (weights,
    gradients and Adam's two moments in training.dtype, sharded over every parallel dimension) and the
    activation bound, against `device_memory` bytes (None: not known, nothing checked)."""
    from trainer.config.errors import ConfigError
    from trainer.models.llama3.args import num_params
    from trainer.models.llama3.hf_config import configured_model_args

    if device_memory is None:
        return
    shards = dims.dp_shard * dims.cp * dims.tp * dims.pp
    state = state_bytes_per_parameter(config) * num_params(configured_model_args(config.model)) // shards
    bound = activation_bound(config, dims.tp, dims.cp, dims.pp, "cuda")
    if state + bound.bytes <= device_memory:
        return
    limit = bound.seq_len_limit(device_memory - state, config.training.seq_len)
    raise ConfigError(
        f"training.seq_len {config.training.seq_len}, local_batch_size {config.training.local_batch_size}: a rank's "
        f"step needs at least {state / 2 ** 30:.1f} GiB of model state and {bound.bytes / 2 ** 30:.1f} GiB of "
        f"activations ({bound.tokens:,} tokens), but its GPU has {device_memory / 2 ** 30:.1f} GiB; use a shorter "
        f"training.seq_len{limit}, a smaller training.local_batch_size, activation_checkpoint.mode 'full', or more "
        "ranks to shard over")

"""What the estimator prints: per rank kind, the state and peak memory, whether it fits the
device, the communication per mesh dimension, and advice for a rank that does not fit."""

from __future__ import annotations

from trainer.estimate.rank import RankEstimate

GIB = 2 ** 30
# Left free on the device for what the fake step cannot see: the CUDA context, the caching
# allocator's fragmentation, NCCL's buffers.
DEVICE_RESERVE = 0.10

OP_NAMES = {"_allgather_base_": "all-gather", "all_gather_into_tensor": "all-gather", "allgather_": "all-gather",
            "_reduce_scatter_base_": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
            "reduce_scatter_": "reduce-scatter", "allreduce_": "all-reduce", "all_reduce": "all-reduce",
            "send": "send", "recv_": "recv", "broadcast_": "broadcast", "all_to_all_single": "all-to-all"}


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def usable(device_memory: int) -> int:
    return int(device_memory * (1 - DEVICE_RESERVE))


def fits(estimate: RankEstimate, device_memory: int) -> bool:
    return estimate.peak <= usable(device_memory)


def memory_table(estimates: list[RankEstimate], device_memory: int) -> str:
    """One row per rank kind, GiB."""
    header = ("rank kind", "ranks", "params", "weights", "grads", "optim", "step peak", "of which: params",
              "grads", "optim", "activations", "temporaries", "init peak", f"fits {device_memory / GIB:.4g} GiB")
    rows = [header]
    for e in estimates:
        s, p = e.state, e.step_peak
        rows.append((e.kind.name, e.kind.ranks, f"{e.parameter_count / 1e6:,.1f}M", gib(s.parameters),
                     gib(s.gradients), gib(s.optimizer), gib(p.total), gib(p.parameters), gib(p.gradients),
                     gib(p.optimizer), gib(p.activations), gib(p.temporaries), gib(e.init_peak.total),
                     f"{'yes' if fits(e, device_memory) else 'NO'} ({100 * e.peak / device_memory:.0f}%)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def communication_lines(estimate: RankEstimate) -> list[str]:
    """`dp_shard_cp: all-gather 16 calls 11.62 GiB, ...` per mesh dimension, one training step."""
    lines = []
    for dimension, ops in sorted(estimate.collectives.items()):
        merged: dict[str, list[int]] = {}
        for op, figures in ops.items():
            entry = merged.setdefault(OP_NAMES.get(op, op), [0, 0])
            entry[0] += figures["calls"]
            entry[1] += figures["bytes"]
        parts = [f"{name} {calls} calls {gib(size)} GiB" for name, (calls, size) in sorted(merged.items())]
        # "other": the default group of all ranks (the gradient-norm all-reduce when no mesh dimension spans the world)
        lines.append(f"{'world' if dimension == 'other' else dimension}: " + ", ".join(parts))
    return lines


def advice(estimate: RankEstimate, device_memory: int) -> str:
    """Why a rank does not fit and its largest contributors."""
    peak = estimate.step_peak if estimate.step_peak.total >= estimate.init_peak.total else estimate.init_peak
    parts = sorted(((name, size) for name, size in peak.as_dict().items() if name != "total"), key=lambda kv: -kv[1])
    largest = ", ".join(f"{name} {gib(size)} GiB" for name, size in parts[:3])
    phase = "step" if peak is estimate.step_peak else "initialization"
    return (f"{estimate.kind.name} (ranks {estimate.kind.ranks}) needs {gib(estimate.peak)} GiB, more than "
            f"{gib(usable(device_memory))} GiB usable of {gib(device_memory)} GiB "
            f"({100 * DEVICE_RESERVE:.0f}% kept for the CUDA context, allocator and NCCL buffers); largest at the "
            f"{phase} peak: {largest}")


def change_lines(tried) -> list[str]:
    """One line per change estimated: its peak and whether it fits."""
    lines = []
    for t in tried:
        if t.peak is None:
            lines.append(f"  {t.change.description}: cannot run this job ({t.reason})")
        else:
            lines.append(f"  {t.change.description}: peak {gib(t.peak)} GiB, {'fits' if t.fits else 'does not fit'}")
    return lines


def change_json(tried) -> dict:
    return {"change": tried.change.description, "nproc": tried.change.nproc, "overrides": list(tried.change.overrides),
            "peak_bytes": tried.peak, "fits": tried.fits, "reason": tried.reason}


def as_json(estimates: list[RankEstimate], device_memory: int) -> list[dict]:
    return [{
        "kind": e.kind.name, "rank": e.kind.rank, "ranks": e.kind.ranks, "stages": list(e.kind.stages),
        "parameter_count": e.parameter_count,
        "state_bytes": {"parameters": e.state.parameters, "gradients": e.state.gradients,
                        "optimizer": e.state.optimizer},
        "step_peak_bytes": e.step_peak.as_dict(), "init_peak_bytes": e.init_peak.as_dict(),
        "fits": fits(e, device_memory), "collectives": e.collectives, "seconds": round(e.seconds, 1),
    } for e in estimates]

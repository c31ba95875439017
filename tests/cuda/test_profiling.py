"""[profiling] on the device: traces every profile_freq steps, with the device's kernels on CUDA;
CUDA memory snapshots on CUDA, refused on the CPU."""

from __future__ import annotations

import json
import pickle

from tests.cuda.device import DEVICE, JOB, dtype_args, train
from tests.launch import describe

PROFILED = [*JOB, *dtype_args("float32"), "--profiling.enable_profiling", "--profiling.profile_freq", "5",
            "--profiling.profiler_warmup", "1"]


def test_traces_and_memory_snapshots(tmp_path, figure):
    result = train([*PROFILED, "--profiling.enable_memory_snapshot", "--job.dump_folder", str(tmp_path)])
    if DEVICE == "cpu":
        assert result.returncode == 2, describe(result)
        assert "profiling.enable_memory_snapshot: records the CUDA caching allocator" in result.stderr
        result = train([*PROFILED, "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    for step in (5, 10):
        trace = json.loads((tmp_path / "profile_traces" / f"iteration_{step}" / "rank0_trace.json").read_text())
        categories = {event.get("cat") for event in trace["traceEvents"]}
        assert "cpu_op" in categories
        if DEVICE == "cuda":
            assert "kernel" in categories, sorted(c for c in categories if c)
            snapshot = tmp_path / "memory_snapshot" / f"iteration_{step}" / "rank0_memory_snapshot.pickle"
            with open(snapshot, "rb") as f:
                assert pickle.load(f)["segments"], snapshot
    kernels = sum(e.get("cat") == "kernel" for e in trace["traceEvents"])
    figure(f"profiling: traces at steps 5 and 10, {len(trace['traceEvents'])} events in the last, {kernels} kernels"
           + (", memory snapshots written" if DEVICE == "cuda" else "; memory snapshot refused on the CPU"))

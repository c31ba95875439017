"""[profiling]: which steps the traces and memory snapshots cover, their files, and the checks of
the section's values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.config.job_config import JobConfig, Profiling
from trainer.config.manager import ConfigError, load_config
from trainer.preflight.checks import check_device_options
from trainer.preflight.checks import main as preflight_main
from trainer.metrics.profiling import StepProfiler

CPU = torch.device("cpu")


def trained_steps(profiler: StepProfiler, steps: range) -> None:
    """A stand-in for training steps: a matrix product per step, then profiler.step."""
    x = torch.ones(16, 16)
    for step in steps:
        torch.mm(x, x).sum()
        profiler.step(step)


def traced(folder: Path) -> dict[int, list[str]]:
    """step -> trace file names in the trace folder."""
    return {int(d.name.removeprefix("iteration_")): sorted(f.name for f in d.iterdir())
            for d in folder.glob("iteration_*")}


def test_windows_end_at_multiples_of_profile_freq_after_a_resume(tmp_path):
    config = Profiling(enable_profiling=True, profile_freq=4, profiler_warmup=1, profiler_active=2)
    with StepProfiler(config, tmp_path, rank=3, device=CPU, last_step=5) as profiler:
        trained_steps(profiler, range(6, 15))  # resumed after step 5; windows 7-8 and 11-12, 15-16 not reached
    assert traced(tmp_path / "profile_traces") == {8: ["rank3_trace.json"], 12: ["rank3_trace.json"]}
    trace = json.loads((tmp_path / "profile_traces/iteration_12/rank3_trace.json").read_text())
    names = [event.get("name", "") for event in trace["traceEvents"]]
    assert names.count("aten::mm") == 2  # the two recorded steps, not the warmup step
    assert sum(name.startswith("ProfilerStep#") for name in names) == 2


def test_a_window_cut_short_writes_no_trace(tmp_path):
    config = Profiling(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=2)
    with StepProfiler(config, tmp_path, rank=0, device=CPU) as profiler:
        trained_steps(profiler, range(1, 6))  # step 5 of the window 5-6 is recorded, then the run ends
    assert traced(tmp_path / "profile_traces") == {3: ["rank0_trace.json"]}


def test_nothing_is_written_when_profiling_is_off(tmp_path):
    with StepProfiler(Profiling(profile_freq=1, profiler_warmup=0), tmp_path, rank=0, device=CPU) as profiler:
        trained_steps(profiler, range(1, 3))
    assert list(tmp_path.iterdir()) == []


class FakeAllocatorHistory:
    """torch.cuda.memory's history functions, recorded instead of run (CUDA is not here)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                            lambda enabled="all", **kwargs: self.calls.append(("record", enabled, kwargs)))
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self.dump)

    def dump(self, filename: str) -> None:
        self.calls.append(("dump", filename))
        Path(filename).write_bytes(b"snapshot")


def test_memory_snapshots_every_profile_freq_steps_and_when_a_step_runs_out_of_memory(tmp_path, monkeypatch):
    history = FakeAllocatorHistory(monkeypatch)
    config = Profiling(enable_memory_snapshot=True, profile_freq=2, profiler_warmup=0)
    with pytest.raises(torch.OutOfMemoryError):
        with StepProfiler(config, tmp_path, rank=1, device=torch.device("cuda", 0)) as profiler:
            for step in range(1, 6):
                profiler.step(step)
            raise torch.OutOfMemoryError("CUDA out of memory")  # step 6
    folder = tmp_path / "memory_snapshot"
    assert history.calls == [
        ("record", "all", {"max_entries": 100_000}),
        ("dump", str(folder / "iteration_2/rank1_memory_snapshot.pickle")),
        ("dump", str(folder / "iteration_4/rank1_memory_snapshot.pickle")),
        ("dump", str(folder / "iteration_6_exit/rank1_memory_snapshot.pickle")),
        ("record", None, {}),  # the history stops, also after an error
    ]


def test_other_errors_write_no_exit_snapshot(tmp_path, monkeypatch):
    history = FakeAllocatorHistory(monkeypatch)
    config = Profiling(enable_memory_snapshot=True, profile_freq=10)
    with pytest.raises(RuntimeError):
        with StepProfiler(config, tmp_path, rank=0, device=torch.device("cuda", 0)) as profiler:
            profiler.step(1)
            raise RuntimeError("not a memory problem")
    assert [call[0] for call in history.calls] == ["record", "record"]


# ---------------------------------------------------------------------------- checks
def test_memory_snapshots_are_refused_on_the_cpu(capsys):
    config = load_config(["--profiling.enable_memory_snapshot"])
    with pytest.raises(ConfigError, match=r"^profiling.enable_memory_snapshot: .*needs CUDA devices.*on the CPU"):
        check_device_options(config, "cpu")
    check_device_options(config, "cuda")
    assert preflight_main(["--nproc", "2", "--device", "cpu", "--profiling.enable_memory_snapshot"]) == 2
    assert capsys.readouterr().err.count("profiling.enable_memory_snapshot") == 1


def config_error(*args: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(list(args))
    return str(error.value)


def test_profiling_values_are_checked_with_every_problem_named():
    message = config_error("--profiling.profile_freq", "0", "--profiling.profiler_warmup", "-1",
                           "--profiling.profiler_active", "0")
    assert "profiling.profile_freq: must be >= 1, got 0" in message
    assert "profiling.profiler_warmup: must be >= 0, got -1" in message
    assert "profiling.profiler_active: must be >= 1, got 0" in message


def test_warmup_and_active_steps_must_fit_in_one_window():
    message = config_error("--profiling.profile_freq", "4", "--profiling.profiler_warmup", "3",
                           "--profiling.profiler_active", "2")
    assert "profiling.profiler_warmup + profiling.profiler_active: 3 + 2 steps must fit in one " \
           "profiling.profile_freq window of 4 steps" in message
    assert "raise profile_freq to at least 5" in message
    config = load_config(["--profiling.profile_freq", "5", "--profiling.profiler_warmup", "3",
                          "--profiling.profiler_active", "2"])  # back to back: allowed
    assert config.profiling.profile_freq == 5
    defaults = JobConfig().profiling
    assert defaults.profiler_warmup + defaults.profiler_active <= defaults.profile_freq

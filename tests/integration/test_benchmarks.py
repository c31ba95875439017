"""The benchmark scripts run, on the tiny model, and what they measure holds: FSDP divides the
per-rank model state by its degree, and the data-parallel strategies train identically."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.launch import REPO


def run_script(name: str, *args: str, timeout: int = 600) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the tests measure on CPUs, also on a GPU machine
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *args], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def table_rows(output: str) -> list[list[str]]:
    """The body rows of the markdown tables in `output`."""
    lines = [line for line in output.splitlines() if line.startswith("|") and not line.startswith("|:")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_fsdp_divides_model_state_by_its_degree(tmp_path, measured):
    out = run_script("memory_scaling.py", "--flavor", "tiny", "--degrees", "1,2", "--seq-len", "16",
                     "--json", str(tmp_path / "m.json"))
    one, two = json.loads((tmp_path / "m.json").read_text())
    assert (one["degree"], two["degree"]) == (1, 2)
    assert one["params"] == one["grads"] > 0 and one["optimizer"] == 2 * one["params"]  # AdamW: two moments
    # Every tiny-model dimension is even: each of the 2 shards holds exactly half, no padding.
    for kind in ("params", "grads", "optimizer", "total"):
        assert 2 * two[kind] == one[kind], kind
    assert [row[5] for row in table_rows(out)] == ["1.0000", "0.5000"]
    measured(f"memory_scaling (tiny): model state per rank {one['total']} bytes at FSDP 1, {two['total']} at FSDP 2")


def test_strategies_train_identically_and_ddp_holds_everything(tmp_path, measured):
    run_script("strategies.py", "--flavor", "tiny", "--nproc", "2", "--steps", "3", "--seq-len", "32",
               "--only", "DDP,FSDP (reshard)", "--ac", "none", "--json", str(tmp_path / "s.json"))
    runs = {(r["strategy"], r["ac"]): r for r in json.loads((tmp_path / "s.json").read_text())}
    assert set(runs) == {("DDP", "none"), ("FSDP (reshard)", "none")}
    losses = [r["loss"] for r in runs.values()]
    assert max(losses) - min(losses) <= 1e-5, losses
    assert runs["DDP", "none"]["state"] == 2 * runs["FSDP (reshard)", "none"]["state"] > 0
    assert all(r["step_s"] > 0 for r in runs.values())
    measured(f"strategies (tiny, 2 procs): loss after 3 steps {min(losses):.6f}..{max(losses):.6f} over 2 runs")


def test_overhead_and_profile_scripts_run():
    out = run_script("overhead.py", "--model.flavor", "tiny", "--block-steps", "2", "--blocks", "2")
    assert [r[0] for r in table_rows(out)] == ["plain", "trainer"]
    assert "trainer / plain tokens/s:" in out
    out = run_script("profile_step.py", "--model.flavor", "tiny", "--steps", "3", "--top", "5")
    phases = [r[0] for r in table_rows(out)][:7]
    assert phases[:2] == ["data loader", "forward + backward"] and phases[-1] == "step"


def test_optimizer_update_benchmark_times_both_paths():
    out = run_script("optimizer_update.py", "--layouts", "FSDP", "--steps", "1")
    rows = table_rows(out)
    assert [row[:2] for row in rows] == [["FSDP", "local shards"], ["FSDP", "DTensor"]]
    assert all(float(cell) >= 0 for row in rows for cell in row[2:])


def test_memory_phases_reads_the_resident_set_after_each_phase():
    out = run_script("memory_phases.py", "--nproc", "1", "--flavor", "tiny", "--steps", "1")
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["start", "model built", "step 1: forward + backward",
                                    "step 1: clip + optimizer step", "step 1: zero_grad"]
    resident, high_water = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
    assert all(0 < rss <= hwm for rss, hwm in zip(resident, high_water))
    assert high_water == sorted(high_water)  # a high-water mark never falls


def test_shard_reading_keeps_memory_flat_and_the_data_costs_no_start_up(tmp_path, measured):
    out = run_script("data_shards.py", "--sizes-gb", "0.04", "--folder", str(tmp_path), "--text-mb", "1")
    reading = [line.split() for line in out.splitlines() if "GB text-equiv." in line]
    assert len(reading) == 1
    tokens, rss_growth = int(reading[0][3].replace(",", "")), float(reading[0][-2])
    assert tokens == 10_000_000 and rss_growth < 32  # 1,608 sequences of 2049 tokens read: 6.6 MB as int16
    start = {line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1]) for line in out.splitlines()
             if line.startswith(("synthetic data", "0.04 GB text-equivalent shards"))}
    assert len(start) == 2
    prepare = [line for line in out.splitlines() if line.startswith("prepare (1 MB jsonl)")]
    assert len(prepare) == 4
    single = [line for line in out.splitlines() if line.startswith("prepare (one 1 MB jsonl file")]
    assert [line.split(":")[1].split()[0:2] for line in single] == [["one", "part"], ["8", "ranges"]]
    measured(f"data_shards (0.04 GB): resident memory growth {rss_growth} MB; trainer start {start}")


def test_document_masking_benchmark_runs(measured):
    out = run_script("document_masking.py", "--seq-len", "128", "--steps", "4")
    row = out.strip().splitlines()[-1].split()  # seq_len, kernel, tokens/s plain and masked, ratio, losses
    assert row[:2] == ["128", "mask"] and float(row[5]) > 0 and float(row[6]) > 0
    measured(f"document_masking (seq 128, 4 steps): masked/plain tokens/s {row[4]}")


def test_data_streams_benchmark_reads_each_ranks_lanes_only(tmp_path, measured):
    out = run_script("data_streams.py", "--text-mb", "2", "--files", "8", "--tokens", "20000", "--warmup-tokens",
                     "20000", "--step-ms", "5", "--folder", str(tmp_path))
    rows = {tuple(line.split()[:3]): line.split() for line in out.splitlines()
            if len(line.split()) == 6 and line.split()[0].isdigit()}
    assert [rows[key][3] for key in (("1", "2", "0"), ("2", "2", "0"), ("4", "2", "1"), ("8", "1", "1"))] == \
        ["1", "1", "2", "8"]  # lanes a DP rank reads: all with one lane, its own otherwise
    assert all(float(row[4].replace(",", "")) > 0 for row in rows.values())
    waits = [line for line in out.splitlines() if line.startswith(("in the training process", "1 worker process"))]
    assert len(waits) == 2
    measured(f"data_streams (2 MB): {len(rows)} configurations; {waits}")


@pytest.mark.smoke
def test_tied_init_prints_one_row_per_std():
    out = run_script("tied_init.py", "--flavor", "tiny", "--steps", "3")
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["dim^-0.5 (the trainer's)", "0.02", "1/dim"]
    assert [float(r[1]) for r in rows] == [0.125, 0.02, 0.0156]
    # Step 1 loss grows with the std: the current token's own logit starts near dim x std.
    first = [float(r[2]) for r in rows]
    assert first[0] > first[1] > math.log(256) - 0.1, first


def test_ring_attention_with_documents_holds_memory_falling_as_one_over_cp(measured):
    """benchmarks/cp_document_memory.py at 4,096 tokens: computed in tiles of query rows, a rank's
    peak with document masking falls as 1 / cp (peak x cp within 1.5x across degrees 2-8), on the
    CPU kernel and on CUDA's math kernel; whole masked pairs on the math kernel (chunk x chunk
    float32 scores per head, as before) hold more than twice the tiles' peak at cp 2."""
    rows = table_rows(run_script("cp_document_memory.py", "--seq-lens", "4096", "--cp", "2", "4", "8",
                                 "--fake-seq-len", "0"))
    for kernel in ("cpu flash", "math"):
        scaled = {int(r[2]): float(r[4].replace(",", "")) for r in rows if r[1] == kernel}
        measured(f"cp documents {kernel}: peak x cp {scaled}")
        assert set(scaled) == {2, 4, 8} and max(scaled.values()) <= 1.5 * min(scaled.values())
    [math_cp2] = [r for r in rows if r[1] == "math" and r[2] == "2"]
    assert float(math_cp2[5]) > 2 * float(math_cp2[3])


def test_suite_cpu_adds_each_tests_forks_to_its_own_processes(tmp_path):
    lines = [{"test": "tests/a.py::test_one", "wall": 3.0, "cpu": 0.5, "machine_cpu": 5.0, "cores": 1},
             {"test": "tests/b.py::test_two[x]", "wall": 1.0, "cpu": 1.5, "machine_cpu": 2.0, "cores": 1},
             {"fork": "module trainer.launch", "test": "tests/a.py::test_one", "cpu": 0.25},
             {"fork": "module trainer.train", "test": "tests/a.py::test_one", "cpu": 2.0},
             {"fork": "module trainer.train", "test": "tests/a.py::test_one", "cpu": 2.0},
             {"fork": "code from multiprocessing.forkserver import main; main(3)", "test": "", "cpu": 0.5},
             {"fork": "script /tmp/b0/probe.py", "test": "tests/b.py::test_two[x]", "cpu": 0.125},
             {"fork": "script /tmp/b1/probe.py", "test": "tests/b.py::test_two[x]", "cpu": 0.125}]
    log = tmp_path / "cpu.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = run_script("suite_cpu.py", str(log))
    assert out.splitlines()[0].startswith("2 tests: 2 CPU-seconds in the tests' processes, 5 in 6 forks of the warm "
                                          "Python, 7 in all")
    kinds, files, tests = (table_rows(part) for part in out.split("\n\n")[1:])
    assert kinds == [["module trainer.train", "4.0", "2", "2.00"], ["code (python -c)", "0.5", "1", "0.50"],
                     ["module trainer.launch", "0.2", "1", "0.25"], ["script probe.py", "0.2", "2", "0.12"]]
    assert files == [["tests/a.py", "4.8"], ["tests/b.py", "1.8"], ["(outside any test)", "0.5"]]
    assert tests[0] == ["tests/a.py::test_one", "4.8", "0.5", "4.2", "3", "3.0"]

    log.write_text(log.read_text() + '{"test": "tests/c.py::test_cut", "wall": 1.0, "cp')  # a run killed mid-write
    refused = subprocess.run([sys.executable, str(REPO / "benchmarks" / "suite_cpu.py"), str(log)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and f"{log}:9: not a TEST_CPU_LOG line" in refused.stderr, refused.stderr

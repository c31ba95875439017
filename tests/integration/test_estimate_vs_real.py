"""The estimator against real runs (benchmarks/estimate_accuracy.py, tiny model): the same job on
CPU once for real under torchrun (gloo) and once on fake tensors in a fake world. What each rank
kind holds (parameters, gradients, optimizer state) must be equal to the byte in every layout the
benchmark covers (1 process, FSDP, FSDP x TP, PP Interleaved1F1B, CP, FSDP x TP x PP with full and
selective AC) and two more (one process computing in bfloat16, CP over documents); the step peaks of the tracker over real and fake tensors must agree within 5%
(docs/performance_measurements.md gives the figures for larger models).

The script runs end to end on its one-process layout. The other layouts are compared by the
script's own functions in this process (`compare`: the estimator's processes, the rows), their
real steps measured by the script's own worker, the layouts of one process count one after the
other in one process group (tests/workers/estimate_layouts.py): 3 starts of torchrun and 14 of
the trainer rather than 6 and 26."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.test_benchmarks import run_script
from tests.launch import REPO, describe

FLAVOR, SEQ_LEN = "tiny", 32
ONE_PROCESS = "1 process"


def benchmark():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import estimate_accuracy
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return estimate_accuracy


def real_steps(layouts: dict[str, tuple[int, list[str]]], folder: Path) -> dict[str, dict[int, dict]]:
    """layout -> rank -> its figures, from one torchrun per process count."""
    folders = {name: folder / str(index) for index, name in enumerate(layouts)}
    for nproc in sorted({nproc for nproc, _ in layouts.values()}):
        spec = [{"out": str(folders[name] / "figures"), "overrides": [*overrides, "--job.dump_folder",
                                                                       str(folders[name] / "run")]}
                for name, (n, overrides) in layouts.items() if n == nproc]
        for layout in spec:
            Path(layout["out"]).mkdir(parents=True)
        (folder / f"spec{nproc}.json").write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               str(nproc), "-m", "tests.workers.estimate_layouts", str(folder / f"spec{nproc}.json")],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert done.returncode == 0, describe(done)
    return {name: {int(f.stem.removeprefix("rank")): json.loads(f.read_text())
                   for f in (folders[name] / "figures").glob("rank*.json")} for name in layouts}


def more_layouts(folder: Path) -> dict[str, tuple[int, list[str]]]:
    """Beyond the benchmark's: one process computing in bfloat16 over float32 weights (the model's
    own cast, no FSDP), and context parallelism over documents of a small text corpus (the debug
    model, whose vocabulary holds a byte-fallback tokenizer; the estimate takes every chunk pair as
    masked, the real run masks those a boundary crosses)."""
    from tests.unit.test_tokenizer import sentences
    from trainer.data.tokenizer_train import train_tokenizer

    corpus = folder / "docs.jsonl"
    texts = sentences(1_200, seed=5)
    corpus.write_text("".join(json.dumps({"text": " ".join(texts[i:i + 3])}) + "\n" for i in range(0, 1_200, 3)))
    tokenizer = train_tokenizer([str(corpus)], str(folder / "tok"), 512)
    documents = ["--training.dataset", "files", "--training.dataset_path", str(corpus), "--model.tokenizer_path",
                 str(tokenizer), "--training.document_masking", "--model.flavor", "debugmodel"]  # 512 tokens fit its vocabulary
    return {"1 process, bfloat16 compute": (1, ["--training.mixed_precision_param", "bfloat16"]),
            "CP 2, document masking": (2, ["--parallelism.context_parallel_degree", "2", *documents])}


def test_estimated_state_bytes_equal_the_real_runs(tmp_path, measured, monkeypatch):
    run_script("estimate_accuracy.py", "--flavor", FLAVOR, "--seq-len", str(SEQ_LEN), "--layouts", ONE_PROCESS,
               "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {row["layout"] for row in rows} == {ONE_PROCESS}

    bench = benchmark()
    # The script's job (its main): the tiny model in float32, local batch 4.
    job = ["--model.flavor", FLAVOR, "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "4",
           "--metrics.no_enable_tensorboard", "--training.mixed_precision_param", "float32"]
    others = {name: (nproc, [*job, *args]) for name, (nproc, args) in bench.LAYOUTS.items() if name != ONE_PROCESS}
    others |= {name: (nproc, [*job, *args]) for name, (nproc, args) in more_layouts(tmp_path).items()}
    real = real_steps(others, tmp_path / "real")
    for name, (nproc, overrides) in others.items():
        monkeypatch.setattr(bench, "real_run", lambda nproc, overrides, folder, name=name: real[name])
        rows += bench.compare(name, nproc, overrides, tmp_path / "compare")

    assert len({row["layout"] for row in rows}) == 7 + 2
    assert {row["kind"] for row in rows} == {"every rank", "first pipeline rank (0)", "last pipeline rank (1)"}
    for row in rows:
        assert row["estimated_state"] == row["real_state"], row
        difference = row["estimated_peak"] / row["real_peak"] - 1
        assert abs(difference) < 0.05, row
        measured(f"estimate vs real (tiny), {row['layout']:36s} {row['kind']:24s}: state {sum(row['real_state'])} B "
                 f"equal; step peak {row['estimated_peak']} B estimated, {row['real_peak']} B real "
                 f"({100 * difference:+.1f}%)")

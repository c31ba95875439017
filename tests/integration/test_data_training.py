"""Training on the data sources end to end."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from tests.launch import describe, launch, read_metrics, run_many
from tests.unit.test_tokenizer import sentences
from tests.unit.test_tokenizers import write_tiktoken_ranks
from trainer.data.hashing import document_unit
from trainer.data.prepare import prepare
from trainer.data.synthetic import SyntheticMarkovSource
from trainer.data.tokenizer import load_tokenizer, tokenize_documents, train_hf_tokenizer, train_tokenizer
from trainer.models.llama3.args import get_flavor
from trainer.models.llama3.hf_config import hf_config


def test_synthetic_loss_approaches_the_entropy_floor(tmp_path):
    # One process, one thread (tests/conftest.py): the same numbers as with two, in far less CPU time.
    result = launch(1, [
        "--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "16",
        "--training.steps", "200", "--optimizer.lr", "1e-2", "--optimizer.weight_decay", "0",
        "--lr_scheduler.warmup_steps", "10", "--lr_scheduler.decay_ratio", "0.3", "--metrics.log_freq", "50",
        "--metrics.no_enable_tensorboard", "--validation.enable", "--validation.freq", "100",
        "--validation.local_batch_size", "16", "--validation.seq_len", "64", "--validation.steps", "4",
        "--job.dump_folder", str(tmp_path),
    ])
    assert result.returncode == 0, describe(result)
    floor = SyntheticMarkovSource(vocab_size=256, seed=0).entropy_floor
    assert f"best achievable loss {floor:.4f}" in result.stdout
    records = read_metrics(tmp_path)
    train = [r for r in records if "kind" not in r]
    validation = [r for r in records if r.get("kind") == "validation"]
    assert [r["step"] for r in validation] == [100, 200]
    first, last, val = train[0]["loss"], train[-1]["loss"], validation[-1]["validation/loss"]
    print(f"tiny model, synthetic source, 200 steps: loss {first:.3f} -> {last:.3f} (validation {val:.3f}); "
          f"floor {floor:.3f}; gap {last - floor:.3f} (validation gap {val - floor:.3f}) nats")
    assert first - floor > 3.0
    assert 0 < val - floor < 0.45  # nothing beats the floor; 200 steps get close to it
    assert abs(val - last) < 0.15  # held-out walks of the same chain: no overfitting


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    """jsonl documents, a local hub-style folder of the same, and a SentencePiece model."""
    folder = tmp_path_factory.mktemp("text")
    docs = sentences(3000)
    with open(folder / "docs.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    (folder / "hub" / "data").mkdir(parents=True)
    for split, part in (("train", docs[:2800]), ("validation", docs[2800:])):
        with open(folder / "hub" / "data" / f"{split}-00000-of-00001.jsonl", "w") as f:
            for doc in part:
                f.write(json.dumps({"text": doc}) + "\n")
    (folder / "hub4" / "data").mkdir(parents=True)  # four data files: four lanes
    for index in range(4):
        with open(folder / "hub4" / "data" / f"train-{index:05d}-of-00004.jsonl", "w") as f:
            for doc in docs[index * 700:(index + 1) * 700]:
                f.write(json.dumps({"text": doc}) + "\n")
    tokenizer = train_tokenizer([str(folder / "docs.jsonl")], str(folder / "tok"), 512)
    return folder, tokenizer


TEXT_JOB = ["--model.flavor", "debugmodel", "--training.seq_len", "32", "--training.local_batch_size", "4",
            "--training.steps", "30", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "3",
            "--metrics.log_freq", "10", "--metrics.no_enable_tensorboard"]
VALIDATION = ["--validation.enable", "--validation.freq", "30", "--validation.local_batch_size", "4",
              "--validation.seq_len", "32", "--validation.steps", "2"]


@pytest.fixture(scope="module")
def shard_folder(text_corpus):
    folder, tokenizer = text_corpus
    prepare([str(folder / "docs.jsonl")], str(tokenizer), str(folder / "shards"), workers=2)
    return folder / "shards"


@pytest.fixture(scope="module")
def text_runs(text_corpus, shard_folder, tmp_path_factory) -> dict[str, dict]:
    """source -> its run's results: the three runs one after the other in one 2-process group
    (tests/workers/run_many.py)."""
    folder, tokenizer = text_corpus
    data = {"files": ["--training.dataset", "files", "--training.dataset_path", str(folder / "docs.jsonl")],
            "shards": ["--training.dataset", "shards", "--training.dataset_path", str(shard_folder)],
            "hub folder": ["--training.dataset", "c4", "--training.dataset_path", str(folder / "hub")]}
    found, _ = run_many(2, [*TEXT_JOB, *VALIDATION, "--model.tokenizer_path", str(tokenizer)], data,
                        tmp_path_factory.mktemp("text-runs"))
    return found


@pytest.mark.parametrize("source", ["files", "shards", "hub folder"])
def test_text_training_on_local_data(text_runs, source):
    records = text_runs[source]["metrics"]
    train = [r for r in records if "kind" not in r]
    validation = [r for r in records if r.get("kind") == "validation"]
    print(f"{source}: loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}, validation {validation[-1]['validation/loss']:.3f}")
    assert train[-1]["loss"] < train[0]["loss"] - 1.5
    assert validation[-1]["validation/loss"] < train[0]["loss"] - 1.5


def test_shards_resume_under_another_global_batch_and_refuse_other_data(tmp_path, shard_folder):
    job = [*TEXT_JOB, "--training.dataset", "shards", "--training.dataset_path", str(shard_folder),
           "--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_model_only", "false",
           "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)]
    first = launch(2, [*job, "--training.steps", "6"])  # global batch 8: 48 sequences
    assert first.returncode == 0, describe(first)
    other_seed = launch(1, [*job, "--training.steps", "8", "--training.data_seed", "5"])
    assert other_seed.returncode == 2
    assert "training data differs from the checkpoint's: shuffle_seed 0 -> 5" in other_seed.stderr
    assert "checkpoint.accept_data_change = true" in other_seed.stderr
    resumed = launch(1, [*job, "--training.steps", "8"])  # one process: global batch 4
    assert resumed.returncode == 0, describe(resumed)
    assert "global batch was 8 sequences, this run's is 4: continuing after sequence 48" in resumed.stdout
    assert [r["step"] for r in read_metrics(tmp_path) if "kind" not in r][-2:] == [7, 8]


def test_a_stream_read_in_lanes_resumes_exactly_under_another_layout(tmp_path, text_corpus):
    """Two ranks read two lanes each (in tokenizer processes); their positions, gathered into the
    checkpoint, let one process continue all four lanes where they were."""
    folder, tokenizer = text_corpus
    job = [*TEXT_JOB, "--training.dataset", "c4", "--training.dataset_path", str(folder / "hub4"),
           "--training.stream_lanes", "4", "--training.global_batch_size", "8", "--model.tokenizer_path",
           str(tokenizer), "--metrics.log_freq", "1",
           "--lr_scheduler.warmup_steps", "10"]  # step s has the same learning rate in a 5- and an 8-step run
    saving = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_model_only", "false",
              "--job.dump_folder", str(tmp_path / "split")]
    whole = launch(2, [*job, "--training.steps", "8", "--job.dump_folder", str(tmp_path / "whole")])
    assert whole.returncode == 0, describe(whole)
    first = launch(2, [*job, *saving, "--training.steps", "5"])
    assert first.returncode == 0, describe(first)
    resumed = launch(1, [*job, *saving, "--training.steps", "8"])
    assert resumed.returncode == 0, describe(resumed)
    assert "Warning" not in whole.stdout + whole.stderr + resumed.stdout + resumed.stderr  # workers start quietly
    assert "this rank reads lanes 0-3, tokenized by 1 worker process per lane" in resumed.stdout
    expected = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "whole") if "kind" not in r}
    continued = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "split") if "kind" not in r}
    assert sorted(continued) == list(range(1, 9))
    for step in range(6, 9):  # fp32: the layouts differ by summation order only
        assert abs(continued[step] - expected[step]) < 1e-4, (step, continued[step], expected[step])


def test_a_weighted_mixture_trains_and_counts_tokens_per_source(tmp_path, text_corpus, shard_folder):
    folder, tokenizer = text_corpus
    job = tmp_path / "mixture.toml"
    job.write_text(f"""
[[training.datasets]]
path = "{shard_folder}"
weight = 3

[[training.datasets]]
dataset = "files"
path = "{folder / 'hub' / 'data' / 'validation-00000-of-00001.jsonl'}"
weight = 1
name = "small"
""")
    result = launch(2, ["--job.config_file", str(job), *TEXT_JOB, *VALIDATION, "--model.tokenizer_path", str(tokenizer),
                        "--job.dump_folder", str(tmp_path / "out")])
    assert result.returncode == 0, describe(result)
    records = read_metrics(tmp_path / "out")
    data = [r for r in records if r.get("kind") == "data"]
    assert [r["step"] for r in data] == [1, 10, 20, 30]
    assert data[-1]["data/shards_tokens"] + data[-1]["data/small_tokens"] == 30 * 8 * 32
    assert abs(data[-1]["data/small_tokens"] / (30 * 8 * 32) - 0.25) < 0.02
    assert [r for r in records if r.get("kind") == "validation"]
    two_names = tmp_path / "twice.toml"
    two_names.write_text(f'[[training.datasets]]\npath = "{shard_folder}"\n[[training.datasets]]\npath = "{shard_folder}"\n')
    refused = launch(2, ["--job.config_file", str(two_names)])
    assert refused.returncode == 2 and "training.datasets[1].name: 'shards' names two sources" in refused.stderr


@pytest.mark.cores(2)
def test_document_masking_trains_the_same_in_every_layout(tmp_path, shard_folder):
    """FSDP 2, TP 2 and CP 2 with attention kept within documents: the same losses (fp32), and
    other losses than plain packing. The four runs share one 2-process group
    (tests/workers/run_many.py); the refusals below go through the launcher."""
    job = [*TEXT_JOB, "--training.steps", "6", "--metrics.log_freq", "1", "--training.dataset", "shards",
           "--training.dataset_path", str(shard_folder), "--training.global_batch_size", "4",
           "--debug.deterministic"]
    masking = ["--training.document_masking"]
    layouts = {"FSDP 2": ["--training.local_batch_size", "2", *masking],
               "TP 2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4", *masking],
               "CP 2": ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4", *masking],
               "FSDP 2, plain packing": ["--training.local_batch_size", "2"]}
    found, _ = run_many(2, job, layouts, tmp_path)
    losses = {name: [r["loss"] for r in found[name]["metrics"] if "kind" not in r] for name in layouts}
    assert "CP 2 (load-balanced ring attention)" in found["CP 2"]["log"]  # the layouts were really applied
    assert "TP 2 with sequence parallelism" in found["TP 2"]["log"]
    reference = losses["FSDP 2"]
    for name in ("TP 2", "CP 2"):
        diff = max(abs(a - b) for a, b in zip(losses[name], reference))
        print(f"document masking, {name} vs FSDP 2: max |loss diff| {diff:.1e} over 6 steps")
        assert len(losses[name]) == 6 and diff < 1e-5
    assert abs(losses["FSDP 2, plain packing"][0] - reference[0]) > 1e-3  # fewer targets, other attention
    pipeline = launch(4, [*job, "--parallelism.pipeline_parallel_degree", "2", "--training.document_masking"])
    assert pipeline.returncode == 2 and "training.document_masking: not available with pipeline" in pipeline.stderr
    synthetic = launch(2, ["--training.document_masking"])
    assert synthetic.returncode == 2 and "the synthetic source has no documents" in synthetic.stderr


@pytest.mark.smoke
def test_data_mistakes_stop_before_launch(tmp_path, text_corpus):
    folder, tokenizer = text_corpus
    too_big = launch(2, ["--model.flavor", "tiny", "--training.dataset", "files", "--training.dataset_path",
                         str(folder / "docs.jsonl"), "--model.tokenizer_path", str(tokenizer)])
    assert too_big.returncode == 2
    assert "has 512 tokens but the model's vocabulary has 256" in too_big.stderr
    missing = launch(2, ["--training.dataset", "files", "--training.dataset_path", str(tmp_path / "none"),
                         "--model.tokenizer_path", str(tokenizer)])
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    no_tokenizer = launch(2, ["--training.dataset", "c4"])
    assert no_tokenizer.returncode == 2 and "model.tokenizer_path" in no_tokenizer.stderr
    (tmp_path / "no_tokenizer").mkdir()
    empty_assets = launch(2, ["--training.dataset", "files", "--training.dataset_path", str(folder / "docs.jsonl"),
                              "--model.hf_assets_path", str(tmp_path / "no_tokenizer")])
    assert empty_assets.returncode == 2
    assert (f"model.hf_assets_path: {tmp_path / 'no_tokenizer'} holds neither tokenizer.json nor tokenizer.model, "
            "and dataset 'files' is text and needs a tokenizer") in empty_assets.stderr
    ignored_path = launch(2, ["--training.dataset_path", str(folder / "docs.jsonl")])
    assert ignored_path.returncode == 2
    assert "training.dataset_path: " in ignored_path.stderr and "training.dataset is 'synthetic'" in ignored_path.stderr
    not_prepared = launch(2, ["--training.dataset", "shards", "--training.dataset_path", str(folder)])
    assert not_prepared.returncode == 2 and "has no manifest.json" in not_prepared.stderr
    prepare([str(folder / "docs.jsonl")], str(tokenizer), str(tmp_path / "all-train"), validation_fraction=0.0)
    no_validation = launch(2, ["--training.dataset", "shards", "--training.dataset_path", str(tmp_path / "all-train"),
                               "--validation.enable"])
    assert no_validation.returncode == 2
    assert "holds 0 validation tokens, fewer than one sequence of 129; prepare it with a larger " \
           "--validation-fraction (it has 0.0)" in no_validation.stderr  # the debug model's seq_len 128


def training_documents(docs: list[str]) -> list[str]:
    """What training reads of local files: all but the held-out share (validation_fraction 0.05)."""
    return [d for d in docs if document_unit(d) >= 0.05]


def corpus_ending_mid_batch(tokenizer, global_batch: int, dp: int, row_length: int = 33) -> list[str]:
    """Documents whose last global batch is incomplete but still holds rank 0's rows: the case in
    which a rank deciding on its own rows trains on while the others stop."""
    tok = load_tokenizer(tokenizer)
    for n in range(30, 200):
        docs = sentences(n, seed=5)
        rows = len(tokenize_documents(training_documents(docs), tok)) // row_length
        if rows % global_batch >= global_batch // dp and rows // global_batch >= 2:
            return docs
    raise AssertionError("no corpus size ends inside rank 0's rows")


@pytest.mark.parametrize("nproc", [2, 4])
def test_finite_dataset_stops_every_rank_at_the_same_step(tmp_path, text_corpus, nproc):
    folder, tokenizer = text_corpus
    global_batch = 4 * nproc
    docs = corpus_ending_mid_batch(tokenizer, global_batch, nproc)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": s}) + "\n" for s in docs))
    result = launch(nproc, [*TEXT_JOB, *VALIDATION, "--validation.dataset", "files", "--validation.dataset_path",
                            str(small), "--training.dataset", "files",
                            "--training.dataset_path", str(small), "--training.dataset_end", "stop",
                            "--model.tokenizer_path", str(tokenizer),
                            "--metrics.log_freq", "1", "--checkpoint.enable", "--job.dump_folder", str(tmp_path / "out")],
                    log_rank=",".join(map(str, range(nproc))))
    assert result.returncode == 0, describe(result)
    whole_batches = len(tokenize_documents(training_documents(docs), load_tokenizer(tokenizer))) // 33 // global_batch
    steps = [r["step"] for r in read_metrics(tmp_path / "out") if "kind" not in r]
    assert steps == list(range(1, whole_batches + 1))
    assert "the dataset ends after" in result.stdout
    for rank in range(nproc):
        assert f"[rank{rank}]:" in result.stdout and f"stopping after {whole_batches} steps" in result.stdout
    assert result.stdout.count(f"stopping after {whole_batches} steps") == nproc
    record = json.loads((tmp_path / "out" / "run_meta.json").read_text())
    assert (record["status"], record["last_step"]) == ("data ended", whole_batches)
    assert (tmp_path / "out" / "checkpoint" / f"step-{whole_batches}" / ".metadata").is_file()  # the end is saved
    validation = [r for r in read_metrics(tmp_path / "out") if r.get("kind") == "validation"]
    assert [r["step"] for r in validation] == [whole_batches]  # and evaluated


def test_validation_loss_is_the_same_in_every_layout(tmp_path):
    """A validation batch of 6 sequences over 1, 2 and 4 data-parallel ranks (padded where uneven)."""
    losses = {}
    for nproc in (1, 2, 4):
        result = launch(nproc, ["--model.flavor", "debugmodel", "--training.seq_len", "32", "--training.steps", "2",
                                "--training.global_batch_size", "8", "--training.local_batch_size", str(8 // nproc),
                                "--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
                                "--validation.global_batch_size", "6", "--validation.local_batch_size", "2",
                                "--debug.deterministic", "--metrics.no_enable_tensorboard",
                                "--job.dump_folder", str(tmp_path / str(nproc))])
        assert result.returncode == 0, describe(result)
        losses[nproc] = [r["validation/loss"] for r in read_metrics(tmp_path / str(nproc)) if r.get("kind")]
    print("validation loss by DP degree:", losses)
    assert len(losses[1]) == 1
    assert abs(losses[2][0] - losses[1][0]) < 1e-5 and abs(losses[4][0] - losses[1][0]) < 1e-5


@pytest.fixture(scope="module")
def own_tokenizers(text_corpus) -> tuple[Path, Path]:
    """A byte-level BPE tokenizer.json trained on the corpus, and a folder laid out like Llama 3's
    original assets: the same merges as tiktoken ranks in tokenizer.model (Llama 3's special
    tokens after them) and a config.json of the debug model's shapes with that vocabulary."""
    folder, _ = text_corpus
    tokenizer_json = train_hf_tokenizer([str(folder / "docs.jsonl")], str(folder / "own_hf"), 1024)
    assets = folder / "llama_assets"
    assets.mkdir()
    ranks = write_tiktoken_ranks(tokenizer_json, assets / "tokenizer.model")
    shapes = replace(get_flavor("debugmodel"), vocab_size=ranks + 256)
    (assets / "config.json").write_text(json.dumps(hf_config(shapes)))
    return tokenizer_json, assets


OWN_TOKENIZER_JOB = [*TEXT_JOB, "--training.steps", "20", "--metrics.log_freq", "5"]


def check_trained(tmp_path: Path, result) -> list[dict]:
    """The training records of a run that trained: every step's loss finite and falling."""
    assert result.returncode == 0, describe(result)
    train = [r for r in read_metrics(tmp_path) if "kind" not in r]
    assert [r["step"] for r in train] == [1, 5, 10, 15, 20]
    losses = [r["loss"] for r in train]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 1.0, losses
    return train


def test_training_with_a_tokenizer_json_of_ones_own(tmp_path, text_corpus, own_tokenizers):
    folder, _ = text_corpus
    tokenizer_json, _ = own_tokenizers
    result = launch(2, [*OWN_TOKENIZER_JOB, "--training.dataset", "files", "--training.dataset_path",
                        str(folder / "docs.jsonl"), "--model.tokenizer_path", str(tokenizer_json),
                        "--job.dump_folder", str(tmp_path)])
    train = check_trained(tmp_path, result)
    tokenizer = load_tokenizer(tokenizer_json)
    assert train[-1]["tokens"] == 20 * 8 * 32  # steps x global batch x sequence length
    unused = f"tokenizer {tokenizer_json} has {tokenizer.vocab_size} tokens, the model's vocabulary 2048"
    assert result.stdout.count(unused) == 1  # said once (by the data pipeline, not again by the preflight)
    assert (f"tokenizer: {tokenizer_json} (huggingface, {tokenizer.vocab_size} tokens, from model.tokenizer_path)"
            in result.stdout)
    docs = [json.loads(line)["text"] for line in (folder / "docs.jsonl").read_text().splitlines()]
    record = json.loads((tmp_path / "run_meta.json").read_text())
    assert record["config"]["model"]["tokenizer_path"] == str(tokenizer_json)
    assert record["data"]["tokens"] == len(tokenize_documents(training_documents(docs), tokenizer))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the checkpoint read in this process
def test_training_with_llama3_style_assets_in_hf_assets_path(tmp_path, text_corpus, own_tokenizers):
    """model.hf_assets_path alone: the shapes from its config.json, the tokenizer its
    tokenizer.model (tiktoken ranks), used by the stream's tokenizer processes; the checkpoint
    records the tokenizer's SHA-256 with the data it trained on."""
    import hashlib

    import torch.distributed.checkpoint as dcp

    folder, _ = text_corpus
    _, assets = own_tokenizers
    result = launch(2, [*OWN_TOKENIZER_JOB, "--model.flavor", "hf", "--model.hf_assets_path", str(assets),
                        "--training.dataset", "c4", "--training.dataset_path", str(folder / "hub"),
                        "--checkpoint.enable", "--checkpoint.interval", "20", "--job.dump_folder", str(tmp_path)])
    train = check_trained(tmp_path, result)
    assert train[-1]["tokens"] == 20 * 8 * 32
    assert "embedding rows are never used" not in result.stdout  # the config.json's vocabulary is the tokenizer's
    assert f"tokenizer: {assets / 'tokenizer.model'} (tiktoken, " in result.stdout
    assert "from model.hf_assets_path)" in result.stdout
    saved = {"dataloader": {"fingerprint": ""}}
    dcp.load(saved, checkpoint_id=str(tmp_path / "checkpoint" / "step-20"), no_dist=True)
    fingerprint = json.loads(saved["dataloader"]["fingerprint"])
    assert fingerprint["tokenizer_sha256"] == hashlib.sha256((assets / "tokenizer.model").read_bytes()).hexdigest()

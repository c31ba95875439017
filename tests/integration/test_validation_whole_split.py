"""validation.steps = -1 through the launcher: every sequence of a 'files' validation split once,
the same loss in two layouts with different validation batch shapes."""

from __future__ import annotations

import json

from tests.launch import describe, launch, read_metrics
from tests.unit.test_tokenizer import sentences
from trainer.data.hashing import document_unit
from trainer.data.tokenizer import load_tokenizer, tokenize_documents
from trainer.data.tokenizer_train import train_tokenizer

FRACTION = 0.3  # training.validation_fraction: the held-out share of the documents
ROW = 33  # seq_len 32 + 1


def test_the_whole_validation_split_gives_the_same_loss_in_every_layout(tmp_path):
    docs = sentences(200, seed=3)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    tokenizer = train_tokenizer([str(corpus)], str(tmp_path / "tok"), 512)
    held_out = [doc for doc in docs if document_unit(doc) < FRACTION]
    sequences = len(tokenize_documents(held_out, load_tokenizer(str(tokenizer)))) // ROW
    job = ["--model.flavor", "debugmodel", "--model.tokenizer_path", str(tokenizer), "--training.dataset", "files",
           "--training.dataset_path", str(corpus), "--training.validation_fraction", str(FRACTION),
           "--training.seq_len", "32", "--training.global_batch_size", "8", "--training.steps", "2",
           "--validation.enable", "--validation.freq", "2", "--validation.steps", "-1", "--debug.deterministic",
           "--metrics.no_enable_tensorboard"]
    layouts = {  # processes, validation global batch, validation local batch
        "1 process, batches of 8": (1, 8, 4),
        "2 processes, batches of 6 (3 per rank, padded)": (2, 6, 2),
    }
    losses = {}
    for name, (nproc, global_batch, local_batch) in layouts.items():
        dump = tmp_path / f"run{nproc}"
        result = launch(nproc, [*job, "--training.local_batch_size", str(8 // nproc),
                                "--validation.global_batch_size", str(global_batch),
                                "--validation.local_batch_size", str(local_batch), "--job.dump_folder", str(dump)])
        assert result.returncode == 0, describe(result)
        batches = -(-sequences // global_batch)
        assert (f"validation data: one evaluation reads the whole split (validation.steps = -1): {sequences} sequences "
                f"of 32 tokens in {batches} batches of {global_batch}") in result.stdout
        [record] = [r for r in read_metrics(dump) if r.get("kind") == "validation"]
        assert record["step"] == 2
        losses[name] = record["validation/loss"]
    print(f"whole validation split of {sequences} sequences, loss by layout: {losses}")
    assert sequences > 20 and sequences % 8 and sequences % 6  # last batches padded in both layouts
    one, two = losses.values()
    assert abs(one - two) < 1e-5

"""The preflight's checks of a run's data, before any process starts: the configured files,
shards and streams exist and fit the model (vocabulary, tokenizer, sequence length), a held-out
split is whole, a mixture's weights can be met. (trainer/preflight/checks.py runs them.) Also the
launcher's preparation of the built-in python_stdlib corpus, once, before the ranks start
(`prepare_builtin_data`): the checks themselves write nothing."""

from __future__ import annotations

import os

from trainer.config.job_config import JobConfig
from trainer.config.manager import ConfigError


def check_data(config: JobConfig) -> None:
    """Cheap checks of the data options: files exist, shard folders are complete, the tokenizer
    loads and fits the model."""
    from trainer.data.documents import DataError

    try:
        _check_data(config)
    except (DataError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _check_data(c: JobConfig) -> None:
    from trainer.data.build import BUILT_IN, SYNTHETIC, check_location, text_dataset
    from trainer.data.documents import find_data_files
    from trainer.data.shards import read_manifest
    from trainer.data.tokenizer import configured_tokenizer, tokenizer_file
    from trainer.models.llama3.hf_config import configured_model_args

    # A config names it whether or not it is there (--job.print_config shows such a config); a run needs it.
    if c.model.hf_assets_path and not os.path.isdir(c.model.hf_assets_path):
        raise ConfigError(f"model.hf_assets_path: {c.model.hf_assets_path} is not a folder")
    vocab_size = configured_model_args(c.model).vocab_size
    fraction = c.training.validation_fraction
    if fraction is not None and not 0 <= fraction < 1:
        raise ConfigError(f"training.validation_fraction: {fraction} is not in [0, 1)")
    sections = _check_mixture(c) or [("training", c.training.dataset, c.training.dataset_path)]
    if c.validation.enable and c.validation.dataset:
        sections.append(("validation", c.validation.dataset, c.validation.dataset_path))
    check_whole_split(c)
    tokenizer = configured_tokenizer(c.model, vocab_size, needed_by=text_dataset(c), say_unused=False)
    tokenizer_key = tokenizer_file(c.model)[1]
    if c.training.document_masking and c.training.dataset in SYNTHETIC and not c.training.datasets:
        raise ConfigError(f"training.document_masking: the {c.training.dataset} source has no documents; use 'shards', 'files' or "
                          "a Hugging Face dataset, or turn it off")
    for key, dataset, path in sections:
        path_key = f"{key}.path" if key.startswith("training.datasets") else f"{key}.dataset_path"
        if dataset in BUILT_IN and path:
            raise ConfigError(f"{path_key}: {path!r} is set but {key}.dataset is {dataset!r}, which is built in and "
                              f"reads no path; leave dataset_path empty, or set {key}.dataset to 'shards' or 'files' "
                              "to read that path")
        if dataset in ("files", "shards") and not path:
            raise ConfigError(f"{path_key}: required for dataset {dataset!r} "
                              + ("(a file, folder or glob)" if dataset == "files" else
                                 "(a folder written by python -m trainer.data.prepare)"))
        if dataset == "files":
            find_data_files(path, path_key)
        if key in ("training", "validation"):  # a named dataset's local copy, or the hub (mixtures hold neither)
            check_location(dataset, path, key)
        if dataset == "shards":
            manifest = read_manifest(path, path_key)
            _check_shards(manifest, path, path_key, vocab_size, (tokenizer, tokenizer_key), fraction)
            if key == "training" and c.validation.enable and not c.validation.dataset:
                _check_held_out(manifest, path, c.validation.seq_len or c.training.seq_len)


def prepare_builtin_data(config: JobConfig, say) -> None:
    """Prepare the python_stdlib corpus the run reads (training or validation), in this process,
    before any rank starts: the ranks then find it complete and only read it. say: where its
    one line goes (the launcher's console)."""
    from trainer.data.build import DEFAULT_VALIDATION_FRACTION, PYTHON_STDLIB
    from trainer.data.documents import DataError
    from trainer.data.python_corpus import ensure_prepared
    from trainer.data.tokenizer import TokenizerError, configured_tokenizer
    from trainer.models.llama3.hf_config import configured_model_args

    c = config
    used = [] if c.training.datasets else [c.training.dataset]
    if c.validation.enable:
        used.append(c.validation.dataset or c.training.dataset)
    if PYTHON_STDLIB not in used:
        return
    vocab_size = configured_model_args(c.model).vocab_size
    fraction = c.training.validation_fraction
    try:
        tokenizer = configured_tokenizer(c.model, vocab_size, say_unused=False)
        ensure_prepared(vocab_size, tokenizer=tokenizer, say=say,
                        validation_fraction=DEFAULT_VALIDATION_FRACTION if fraction is None else fraction)
    except (DataError, TokenizerError) as e:
        raise ConfigError(str(e)) from None


def check_whole_split(c: JobConfig) -> None:
    """validation.steps = -1 reads every sequence of the validation split once: only a finite
    split of known length has that."""
    from trainer.config.validation import WHOLE_SPLIT
    from trainer.data.build import FINITE, SYNTHETIC

    if not c.validation.enable or c.validation.steps != WHOLE_SPLIT:
        return
    fix = "set validation.steps to a number of batches (e.g. 10)"
    if c.training.datasets and not c.validation.dataset:
        raise ConfigError("validation.steps: -1 (the whole validation split) is not defined for a [[training.datasets]] "
                          "mixture, which draws its sources by weight and repeats the small ones; set "
                          f"validation.dataset to one source of known length, or {fix}")
    dataset = c.validation.dataset or c.training.dataset
    if dataset in FINITE:
        return
    why = ("an endless stream" if dataset in SYNTHETIC else
           "streamed, so its length is known only once it has been read")
    raise ConfigError(f"validation.steps: -1 (the whole validation split) needs a split of known length ("
                      f"{', '.join(map(repr, FINITE))}), but the validation data {dataset!r} is {why}; {fix}")


def _check_held_out(manifest: dict, path: str, seq_len: int) -> None:
    tokens = manifest["totals"]["validation"]["tokens"]
    if tokens < seq_len + 1:
        raise ConfigError(f"validation.enable: {path} holds {tokens} validation tokens, fewer than one sequence of "
                          f"{seq_len + 1}; prepare it with a larger --validation-fraction (it has "
                          f"{manifest['validation_fraction']}), set validation.dataset to another source, or lower "
                          "validation.seq_len")


def _check_mixture(c: JobConfig) -> list[tuple[str, str, str]]:
    """[[training.datasets]]: (key, dataset, path) of each source, after checking the weights
    and names; an empty list when there is no mixture."""
    from trainer.data.build import mixture_names
    from trainer.data.mixture import BLOCK, block_counts

    entries = c.training.datasets
    if not entries:
        return []
    if c.training.dataset != "synthetic" or c.training.dataset_path:
        raise ConfigError("training.datasets: a mixture replaces training.dataset / training.dataset_path; "
                          "remove those, or the [[training.datasets]] tables")
    for index, entry in enumerate(entries):
        if not entry.weight > 0:
            raise ConfigError(f"training.datasets[{index}].weight: must be > 0, got {entry.weight}")
    counts = block_counts([entry.weight for entry in entries])
    names = mixture_names(entries)
    for index, (name, count) in enumerate(zip(names, counts)):
        if count == 0:
            raise ConfigError(f"training.datasets[{index}].weight: {entries[index].weight} is less than 1/{BLOCK} of "
                              "the total weight, so no sequence would be drawn from it")
        if name in names[:index]:
            raise ConfigError(f"training.datasets[{index}].name: {name!r} names two sources; give each a name")
    return [(f"training.datasets[{index}]", entry.dataset, entry.path) for index, entry in enumerate(entries)]


def _check_shards(manifest: dict, path: str, path_key: str, vocab_size: int, configured: tuple, fraction) -> None:
    """`configured`: (the job's tokenizer or None, the key that names it)."""
    made_with = manifest["tokenizer"]
    tokenizer, tokenizer_key = configured
    if made_with["vocab_size"] > vocab_size:
        raise ConfigError(f"{path_key}: {path} was tokenized with {made_with['vocab_size']} pieces "
                          f"({made_with['file']}) but the model's vocabulary has {vocab_size}; use a model.flavor "
                          "with a larger vocabulary")
    if tokenizer is not None and tokenizer.sha256 != made_with["sha256"]:
        fix = ("set model.tokenizer_path to that one" if tokenizer_key == "model.hf_assets_path"
               else "use that one, or leave model.tokenizer_path empty (shards need none)")
        raise ConfigError(f"{tokenizer_key}: {tokenizer.path} is not the tokenizer {path} was prepared with "
                          f"({made_with['file']}, SHA-256 {made_with['sha256'][:12]}...); {fix}")
    if fraction is not None and fraction != manifest["validation_fraction"]:
        raise ConfigError(f"training.validation_fraction: {fraction}, but {path} was prepared with "
                          f"{manifest['validation_fraction']}; leave it unset, or prepare the folder again with "
                          f"--validation-fraction {fraction}")

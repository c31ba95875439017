"""Convert between Hugging Face folders and this trainer's DCP checkpoints, in one process.

    python -m trainer.hf import --hf HF_DIR --flavor 8B --out DCP_DIR
    python -m trainer.hf import --hf HF_DIR --flavor hf --out DCP_DIR      (shapes from HF_DIR/config.json)
    python -m trainer.hf export --dcp DCP_DIR --flavor 3B --out HF_DIR [--dtype bfloat16] [--max-shard-size 5GB]

The export reads the checkpoint one tensor at a time and writes safetensors shards of at most
--max-shard-size (model-00001-of-0000N.safetensors and model.safetensors.index.json, as
save_pretrained; a model that fits one shard is written as model.safetensors): it holds about one
shard plus the largest tensor twice, not the model.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from trainer import messages
from trainer.checkpoint.checksums import ChecksumWriter
from trainer.hf.config_json import read_checked_config
from trainer.hf.export import export_hf_folder, parse_size
from trainer.hf.folder import read_hf_folder
from trainer.hf.weights import HFCheckpointError
from trainer.models.llama3.args import LlamaModelArgs
from trainer.models.llama3.hf_config import flavor_names, model_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face folder -> model-only DCP checkpoint")
    imp.add_argument("--hf", required=True)
    imp.add_argument("--flavor", required=True, help=f"one of {', '.join(flavor_names())} (hf: the folder's shapes)")
    imp.add_argument("--out", required=True, help="new checkpoint folder (use it as checkpoint.initial_load_path)")
    exp = commands.add_parser("export", help="DCP checkpoint -> Hugging Face folder")
    exp.add_argument("--dcp", required=True)
    exp.add_argument("--flavor", required=True)
    exp.add_argument("--hf-assets", default="", help='with --flavor hf: the folder whose config.json gives the shapes')
    exp.add_argument("--out", required=True)
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                     help="dtype of the written weights (default float32)")
    exp.add_argument("--max-shard-size", type=_size, default="5GB",
                     help="largest safetensors file: bytes, or with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB "
                          "(default 5GB, as transformers); a tensor larger than this is a file of its own")
    exp.add_argument("--accept-model-change", action="store_true",
                     help="export weights trained with reduced tensor-parallel synchronization, which the exact "
                          "Hugging Face Llama computes differently")
    return parser


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:  # argparse then names the option and exits with status 2
        raise argparse.ArgumentTypeError(str(e)) from None


def refuse_model_change(dcp_dir: Path, accepted: bool) -> None:
    """A checkpoint trained with reduced tensor-parallel synchronization is another model than the
    exact Llama a Hugging Face folder describes: refused unless accepted. Its checkpoint.json is
    beside .metadata, or one folder up for a step's model_only/ export."""
    from trainer.checkpoint.lineage import model_change

    for folder in (dcp_dir, dcp_dir.parent):
        if (folder / "checkpoint.json").is_file():
            change = model_change(folder, {"tensor_parallel_sync": "full"}, "a Hugging Face Llama is")
            if change and not accepted:
                raise HFCheckpointError(change.replace("--checkpoint.accept_model_change", "--accept-model-change"))
            return


def shapes(flavor: str, folder: str, option: str) -> LlamaModelArgs:
    """The model's shapes: a shipped flavor's, or with --flavor hf those of the folder's
    config.json, every field checked first (it may come from anywhere)."""
    if flavor == "hf" and folder:
        read_checked_config(folder, option)
    return model_args(flavor, folder)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.checkpoint as dcp

    messages.configure()
    a = _parser().parse_args(argv)
    try:
        if Path(a.out).exists():
            raise HFCheckpointError(f"--out: {a.out} exists; choose a new folder")
        if a.command == "export" and a.flavor == "hf" and not a.hf_assets:
            raise HFCheckpointError("--flavor hf takes the shapes from a config.json: give --hf-assets FOLDER (the "
                                    "Hugging Face folder the checkpoint was imported from, or any with its shapes)")
        if a.command == "import":
            args = shapes(a.flavor, a.hf, "--hf")
            with warnings.catch_warnings():  # DCP notes that it saves without a process group: intended
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save({"model": read_hf_folder(a.hf, args)}, storage_writer=ChecksumWriter(a.out), no_dist=True)
        else:
            refuse_model_change(Path(a.dcp), a.accept_model_change)
            args = shapes(a.flavor, a.hf_assets, "--hf-assets")
            export_hf_folder(Path(a.dcp), Path(a.out), args, getattr(torch, a.dtype), a.max_shard_size)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

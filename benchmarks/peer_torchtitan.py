"""torchtitan's own trainer on a shape of benchmarks/side_by_side.py (run under torchrun by it).

    torchrun --standalone --nproc-per-node 1 benchmarks/peer_torchtitan.py --shape shape.json \
        --text text.jsonl [--cpu] -- --job.config_file torchtitan.toml

torchtitan (the PyPI release, 0.2.2 on torch 2.11) names its Llama shapes by flavor and its
datasets by name, so this script adds one flavor, "side_by_side", made from shape.json (the
fields of torchtitan's TransformerModelArgs), and one dataset of the same name, a local JSON-lines
file of text (Hugging Face `datasets` reads it; nothing is downloaded), then runs torchtitan's
`main` with the arguments after "--". Everything else is torchtitan's: its model, parallelism,
mixed precision (autocast on one device), compile, activation checkpointing, data loader,
optimizer and its log line of tokens/s and memory, which side_by_side.py reads.

--cpu runs it on the CPU (the dry run of the comparison): torchtitan picks CUDA whenever it is not
told otherwise, so its device module is replaced with the CPU stand-in below, and torch's CPU
builds have no Triton, which torchtitan's MoE kernels (unused by Llama 3) import with the
package, so an empty module takes the kernels' place.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types


class CpuDeviceModule:
    """What torchtitan asks of torch.cuda, answered for the CPU (memory figures read as zero)."""

    def __getattr__(self, attr):
        return lambda *args, **kwargs: None

    @staticmethod
    def get_device_name(*args):
        return "cpu"

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def get_device_properties(*args):
        return types.SimpleNamespace(total_memory=1 << 40, name="cpu")

    @staticmethod
    def memory_stats(*args):
        return {}


def prepare(shape_file: str, text_file: str, cpu: bool) -> None:
    if importlib.util.find_spec("triton") is None:
        # torchtitan's MoE kernels (not used by Llama 3) are Triton code, imported with the package.
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = kernels.fill_indices_wrapper = None
        sys.modules[kernels.__name__] = kernels
    import torchtitan.train  # noqa: F401 (imports the modules whose device globals are replaced below)

    if cpu:  # each torchtitan module copied the device type and module into its globals at import
        for module in [m for name, m in sys.modules.items() if name.startswith("torchtitan")]:
            if getattr(module, "device_type", None) == "cuda":
                module.device_type = "cpu"
            if getattr(module, "device_module", None) is not None:
                module.device_module = CpuDeviceModule()
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    llama3_args["side_by_side"] = TransformerModelArgs(**json.load(open(shape_file)))
    DATASETS["side_by_side"] = DatasetConfig(
        path=text_file, loader=lambda path: load_dataset("json", data_files=path, split="train"),
        sample_processor=lambda sample: sample["text"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, help="JSON file of torchtitan TransformerModelArgs fields")
    parser.add_argument("--text", required=True, help="JSON-lines file of {'text': ...} records")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (dry run)")
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    args = parser.parse_args(sys.argv[1:split])
    # Before torchtitan is imported: its argument parser reads sys.argv as a default bound at import.
    sys.argv = [sys.argv[0], *sys.argv[split + 1:]]
    prepare(args.shape, args.text, args.cpu)
    from torchtitan.train import Trainer, main as torchtitan_main

    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()

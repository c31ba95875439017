"""Llama 3.

`Transformer` is imported on first use: the shapes in `args` must load without torch (the
launcher's preflight validates a config in a light process).
"""

from trainer.models.llama3.args import FLAVORS, LlamaModelArgs, get_flavor

__all__ = ["FLAVORS", "LlamaModelArgs", "Transformer", "get_flavor"]


def __getattr__(name: str):
    if name == "Transformer":
        from trainer.models.llama3.model import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Llama 3."""

from trainer.models.llama3.args import FLAVORS, LlamaModelArgs, get_flavor
from trainer.models.llama3.model import Transformer

__all__ = ["FLAVORS", "LlamaModelArgs", "Transformer", "get_flavor"]

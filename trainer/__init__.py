"""A declarative, TOML-driven trainer for Llama models."""

"""Checks of a run before any process starts (`python -m trainer.preflight`, and the launcher).

- checks.py: the configuration against the world size (degrees, batch split, memory, options).
- data.py: the run's data exist and fit the model; the built-in corpus is prepared once.
- resume.py: what the run would resume from, so that a finished run ends in a second.

Torch-free, so that a mistake is refused before torch loads.
"""

"""Convergence protocol: plan, run and compare N-D layouts against a 1D FSDP control."""

"""What a run measures and where it goes.

- step_log.py: a step's figures (loss, gradient norm, throughput, MFU, memory) into the console
  and metrics.jsonl; writers.py: TensorBoard and Weights & Biases.
- fingerprints.py: per-module fingerprints of chosen steps (metrics.fingerprints), which let the
  protocol say where two layouts part.
- profiling.py: torch.profiler traces and memory snapshots ([profiling]).
"""

"""`python -m trainer.estimate`: one rank of a training job at its real scale, on fake tensors.

The trainer's own code builds the model, applies every configured parallelism, creates the
optimizer and runs full training steps as one rank of a world of any size, in one CPU process:
tensors are fake (shapes and dtypes, no storage, no compute: torch's FakeTensorMode) and the
process group is fake (every collective returns at once: torch's "fake" backend). What the rank
holds and allocates is measured as the step runs (step_memory.StepMemory), and the collectives it
issues are counted with their sizes (trainer.parallel.collectives.CollectiveCounter).

Modules: fake_world (the fake process group and tensor mode), step_memory (the memory tracker),
rank (one rank's estimate), host (the one-process jobs: seed checkpoint, Hugging Face export),
report (tables, JSON, the advice for a rank that does not fit), __main__ (the command line).
"""

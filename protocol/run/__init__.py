"""Running a plan's launches: decide once, then run.

`prepare` decides for every selected launch, before any starts, whether to reuse its run, run it
(and from which checkpoint), leave it stopped, or refuse (a stale run without --rerun-stale, a
folder the protocol did not make); reuse says whether a run's record still matches the plan.
`local` (one run after another on this node) and `slurm` (sbatch jobs) then carry the decisions
out and watch the runs (progress, early-stop rules, how each ended: failures), and `searches`
runs the points a searched sweep needs. folders owns the run folders' markers; outcome is what
each launch came to. render and sbatch write the same launches as a table, a shell script or
SLURM scripts. Imports protocol.plan only.
"""

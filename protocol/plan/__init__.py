"""The plan: what to run and by which rules, before anything runs.

Reading a plan file (load: `load_plan`, with its schema and checks), the model it gives and its
expansion into launches (model), sweeps, the [tolerance], [criterion] and [[early_stop]] tables,
and choosing launches by name (select). Also the plan's rules as they apply to a run's folder,
which running and judging both need: a measure's value (measure), a run's record (records), the
early-stop marker (early_stop), a run judged by the criterion (judging) and the bisection of a
searched sweep (search). Imports nothing of protocol.run, protocol.verdict or protocol.report.
"""

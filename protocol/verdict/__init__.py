"""Judging the runs: from their curves to PASS, FAIL or INCONCLUSIVE.

gather reads what a plan's runs left (each run's curve, or why it has none; run_info describes
each run from its own record); curves reads metrics.jsonl or TensorBoard events. compare judges
every test set against the control family: exact mode step by step, statistical mode per
observable (alignment pairs the steps, statistics and decision hold the rule, statistical_mode
applies it, family_wise keeps the plan's false-fail rate) into results. by_criterion judges the
sets of a plan with a [criterion] instead, with its sweep tables (sweep_table); adhoc compares
folders given on the command line. Imports protocol.plan only, never protocol.run or
protocol.report.
"""

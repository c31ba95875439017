"""Writing the verdict out: report.md and the console table (markdown, with its statistical
sections, findings and number formats), report.json (as_json), one PNG per observable (plots,
plot_verdicts), and a criterion plan's sweep report (sweeps). Reads protocol.verdict's results
and protocol.plan's model; imports nothing of protocol.run.
"""

"""Starting and supervising the ranks of a run (`python -m trainer.launch`).

- launcher.py: checks the configuration, takes the folder's lock, starts the ranks through
  torch's elastic agent and reports how they ended.
- elastic_agent.py: the agent and which failures it restarts (never a user's mistake); how many
  restarts a run gets is the launcher's `restarts_for`; the ranks resume from the newest checkpoint.
- rank_store.py: the store a job's ranks meet at, which the launcher opens for each attempt (imports
  torch: loaded with the agent).
- failure_report.py: which rank failed first and why, as one message and an exit code.
- run_lock.py: one live job per dump folder and per checkpoint folder.
- stop_request.py: save-and-stop on SIGUSR1 (checkpoint.save_on_signal), passed on to the ranks.
- launcher_watch.py: a rank ends when its launcher dies.
- process_exit.py: how a rank ends (exit code, flushed output, its error report for the launcher).

Torch-free at import: the launcher must answer signals and refuse a bad configuration in a second.
"""

"""The small files a run keeps about itself, written safely and read as untrusted.

- run_meta.py: run_meta.json (what ran, from what, how it ended, its warnings) and metrics.jsonl.
- untrusted_json.py: reading records that may have been copied, edited or damaged.
- safe_writes.py: writing records, metric lines and locks never through a link.
"""

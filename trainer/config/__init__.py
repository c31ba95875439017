"""Configuration: dataclass sections (job_config) and their loading (manager)."""

"""train: see docs/architecture.md."""

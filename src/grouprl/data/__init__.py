"""data: see docs/architecture.md."""

"""model: see docs/architecture.md."""

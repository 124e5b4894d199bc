"""rollout: see docs/architecture.md."""

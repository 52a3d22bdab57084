"""rollout/engine package."""

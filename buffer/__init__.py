"""buffer package."""

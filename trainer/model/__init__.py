"""trainer/model package."""

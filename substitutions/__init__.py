"""substitutions package."""

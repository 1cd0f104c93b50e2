"""backend package."""

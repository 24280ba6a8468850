"""browser layer."""

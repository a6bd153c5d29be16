"""zerotune.train."""

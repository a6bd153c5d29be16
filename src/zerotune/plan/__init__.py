"""Memory planning: what a run will hold, per rank, predicted before any weight exists."""

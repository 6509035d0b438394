"""Parameter masks: which weights exist (periodic pruning)."""

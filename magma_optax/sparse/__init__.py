"""Sparse optimizer state: a base optimizer's state kept where weights exist."""

"""Update masks: the paper's methods (which updates land this step)."""

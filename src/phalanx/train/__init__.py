"""Training helpers over whole stacks: per-member losses, label smoothing, clipping, ensemble metrics."""

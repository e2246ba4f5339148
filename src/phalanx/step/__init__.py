"""The captured training step: compile_step, its graph, its compilation and cache key."""

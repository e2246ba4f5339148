"""pytest's own configuration for the suite; the shared helpers are in ``helpers.py``."""

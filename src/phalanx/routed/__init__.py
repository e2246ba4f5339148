"""Routed calls: members= (each row to its own members) and subset= (some members)."""

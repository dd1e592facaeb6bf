"""Helpers shared by the test modules (never test modules themselves)."""

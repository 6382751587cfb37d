"""Strata api package (see README)."""

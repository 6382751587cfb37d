"""Strata fusefs package (see README)."""

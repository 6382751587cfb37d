"""Strata vmm package (see README)."""

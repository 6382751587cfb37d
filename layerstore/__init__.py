"""Strata layer store: content-addressed chunks, layer manifests and refs over a pluggable backend."""

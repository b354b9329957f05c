"""Shared code of the EAGLE-3 pipeline stages."""

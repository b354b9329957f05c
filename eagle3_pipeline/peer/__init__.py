"""Peer trainers run side by side with ours on the same data (SpecForge 0.2.0's offline EAGLE-3 recipe)."""

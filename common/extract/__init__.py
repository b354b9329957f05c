"""Stage 02: batch planning, the extractor and its writers."""

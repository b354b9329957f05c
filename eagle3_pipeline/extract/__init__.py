"""Stage 02: batch planning, the extractor and its writers, the output folder, and the stage run from checked inputs."""

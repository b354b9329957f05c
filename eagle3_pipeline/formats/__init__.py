"""The on-disk contracts between stages: manifests, prepared data, hidden states, vocabulary map, drafter checkpoint."""

"""How a stage runs: flags, errors, logging, progress, torchrun ranks."""

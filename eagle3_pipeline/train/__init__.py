"""Stage 04: data, loss, optimizer, checkpoints, the trainer and data parallelism."""

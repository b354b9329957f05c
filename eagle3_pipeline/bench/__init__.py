"""Stage 05: speculative decoding, prompts, the server benchmark, reports."""

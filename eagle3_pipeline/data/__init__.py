"""Stage 01: chat data, tokenization with loss masks, regeneration."""

"""The verifier: loading it, capturing its layers, and serving it with SGLang."""

"""Model sources (HF folders, GGUF files, the embedded default) and per-architecture adapters."""

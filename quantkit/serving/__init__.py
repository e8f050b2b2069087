"""Will a checkpoint load in a serving engine, and on which kernels (check-serving)."""

"""The sequential layer-wise engine."""

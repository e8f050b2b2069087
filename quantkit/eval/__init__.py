"""Evaluation: perplexity, KL divergence, top-1 agreement, delta-p, tasks, throughput, reports, gates."""

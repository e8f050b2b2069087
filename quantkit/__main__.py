"""`python -m quantkit` (and `torchrun --nproc-per-node N -m quantkit quantize ...`)."""

from quantkit.cli import main

main()

"""The pure core of swapaware: no I/O, no clock, no randomness unless injected."""

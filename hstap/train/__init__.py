"""EAGLE-3 drafter training: training-time test, offline (store) or online (target in-process), DDP-ready."""

"""Linear layers and the one planner that decides which serves each matrix (planner.py); the native kernels beside them."""

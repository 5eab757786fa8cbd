"""The decoder architectures: the model, its blocks and their parts, and the table of families."""

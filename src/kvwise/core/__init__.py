"""Pure-Python bookkeeping (no torch): the block pool, block hashing, the radix prefix cache."""

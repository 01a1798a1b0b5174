"""Fused glue kernels of the decode fast path (router, routed-output combine, the greedy draw's argmax, the
look-ahead prologue): each replaces a chain of small torch ops by one launch; `naive.py` holds the plain-torch
references they are tested against."""

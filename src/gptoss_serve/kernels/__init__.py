"""Compute ops, one public op per module, each with a plain-torch reference.

The references here run on CPU and CUDA and define the numerics; the Triton kernels (GPU
issue) are checked against them through one comparator.
"""

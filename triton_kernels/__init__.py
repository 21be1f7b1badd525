"""Triton kernels of ragattn, one file per kernel family, each with its launch helper.

Set ``TRITON_INTERPRET=1`` before importing these modules to run them on CPU tensors.
"""

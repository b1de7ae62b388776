"""Our own CPU kernels (C++ in `csrc/`, compiled once per ISA on first use, called via ctypes).

They read the tensors they are given at call time, in their checkpoint layout: no prepacked
copy, so weights that are views of another process's shared memory (HMM) stay zero-copy.
Every kernel has a PyTorch fallback that computes the same thing; `ELASTICMOE_KERNELS=0`
forces the fallback (A/B runs, hosts without a C++ compiler).
"""

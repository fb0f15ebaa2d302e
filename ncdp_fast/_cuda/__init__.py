"""CUDA kernels behind the same signatures as the numba ones: one module per
kernel family, as in ``ncdp_fast._numba``.

Pure adaptors: they take the caller's CUDA arrays (torch or CuPy, already
validated, contiguous and on one device), pass their device pointers and the
current stream to ``ncdp_fast._C``, and allocate the workspace the launchers
ask for in the caller's library (so it comes from the library's caching
allocator).  No dispatch decisions are made here; ``_backend.select`` made them.
"""

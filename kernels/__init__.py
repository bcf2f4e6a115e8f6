"""tandem: the reference ops (torch) and the CUDA kernels."""

"""The C++ CPU kernels (csrc/: sources; kernels/ under it: every instruction-set-specific line) and
`cpu_kernels`, which builds each group on its own and loads it, naming the path each takes."""

"""The container benchmark (`bench_container`): write, open and verify times of a .nanoqwen file."""

"""nanoqwen's benchmarks, in one package: the engine benchmark behind `nanoqwen-cli bench` (`engine`),
the workload prompt sets (`workloads`), the kernel microbenchmarks and decode ceilings (`kernels`,
`python -m nanoqwen_bench.kernels`), the benchmark-only GPU tools (`gpu`: read bandwidth, graph
timing), quantization quality and HumanEval (`quality`, `quant`) and the container benchmark
(`format`). Results go to the folder a run is given (`bench/out/...` by default, git-ignored).
Nothing here is imported by the runtime or the server."""

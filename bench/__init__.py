"Chapter benchmarks: one module per chapter, each with a `main()` returning its table (see nbs/90_bench.ipynb)."

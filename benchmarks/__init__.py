"""Speed and memory benchmarks: `make bench` runs every bench_*.py here and prints one table."""

"""The performance room: the memory planner, the cost model, the benchmark, the collective audit and the parity check."""

"""`plait bench ...`: each suite's workers and the command that launches them and prints a
table from rank 0's results live in its own module (`comm.py`: `bench_comm` and `run_comm`, and
so on). Timings live here, never in tests."""

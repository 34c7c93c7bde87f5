"""What drives the engine rather than being it: the ``lfmspark`` command line, the latency and serving
benchmarks, the HF baselines, the kernel timeline of a profile, and the draft's calibration."""

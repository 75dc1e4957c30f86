"""GPU access: NVML (pynvml) and the file-backed fake the dev cluster and the tests use instead of GPUs."""

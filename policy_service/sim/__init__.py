"""Trace-driven simulator: replays a GPU workload through the SAME policy objects the service
uses (``policy_service.core``), over a model of Slurm's scheduling. See docs/simulation.md."""

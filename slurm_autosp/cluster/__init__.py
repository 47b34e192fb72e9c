"""The machines a job runs on: topology (NVLink/xGMI domains), the SP/DP layout derived from
it, the collective and compile-cache environment, torch.distributed, and the scheduler's word
on whether a job lives."""

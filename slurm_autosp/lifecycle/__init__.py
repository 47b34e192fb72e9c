"""A run's life across jobs: its directory, the lock that lets one job train it, the signals
that stop a job, the save schedule and how long a save takes, and the requeue."""

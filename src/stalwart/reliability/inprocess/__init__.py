"""In-process restart: recover from a fault without restarting the job."""

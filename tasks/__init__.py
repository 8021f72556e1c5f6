"""Thin Prefect tasks, one per stage: cache policy, retries, logging. Logic lives in eagle3/."""

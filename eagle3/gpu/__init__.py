"""The GPUs: NVML readings, finding and stopping the processes that hold them, the load preflight.

Imports only eagle3's floor (artifacts, fingerprint).
"""

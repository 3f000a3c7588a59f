"""Analytic FLOPs (MFU), and later the HLO communication reader and the performance model."""

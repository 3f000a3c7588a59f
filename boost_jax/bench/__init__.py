"""Benchmarks: ``python -m boost_jax.bench <name>`` prints a table (speed and memory are
measured here, never asserted in tests).

* ``tp`` -- the three tensor-parallel plans side by side (bench/tp.py).
* ``remat`` -- the activation-checkpointing policies side by side (bench/remat.py).
* ``model`` -- the performance model; ``--paper`` against the paper's rows (bench/model.py).
* ``step`` -- the plans and their GSPMD baselines, with bench.json and figures (bench/step.py).
* ``zero`` -- the data-parallel layouts (ZeRO-1, FSDP) and gradient accumulation (bench/zero.py).
"""

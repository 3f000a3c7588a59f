"""boost_jax: SPMD pre-training of low-rank bottleneck LLMs (SVD, CoLA, LaX) in JAX/Flax.

A JAX reimplementation of BOOST (arXiv 2512.12131): bottleneck-aware tensor parallelism,
online RMSNorm, linear grouping and communication-free low-rank activation checkpointing.
"""

__version__ = "0.1.0"

"""LLaMA-style decoder whose seven projections are dense, SVD, CoLA or LaX (Flax NNX)."""

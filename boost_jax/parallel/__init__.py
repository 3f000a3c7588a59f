"""Meshes, tensor-parallel plans and every collective of boost_jax.

A plan is sharding rules (logical axis -> mesh axis) plus the boundary functions the decoder
calls per device inside a ``jax.shard_map`` region; the model itself holds no collective.
"""

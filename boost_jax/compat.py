"""The few JAX APIs that differ between the CPU machines (jax 0.10.x, Python 3.11) and the GPU
machines (jax 0.11.x), resolved in one place."""

from __future__ import annotations

import jax


def save_only_these_names(*names: str):
    """The remat policy saving only the values tagged with ``names``.

    jax 0.10 spells it as a function; 0.11 turned ``jax.checkpoint_policies`` into a module
    of policy classes (``SaveOnlyTheseNames``) -- use whichever this JAX has.
    """
    policies = jax.checkpoint_policies
    fn = getattr(policies, "save_only_these_names", None)
    if fn is not None:
        return fn(*names)
    return policies.SaveOnlyTheseNames(names)  # pragma: no cover - jax >= 0.11 without the fn


def nothing_saveable():
    """The remat policy that saves nothing (recompute everything)."""
    policy = jax.checkpoint_policies.nothing_saveable
    return policy if callable(policy) and not isinstance(policy, type) else policy()


def dots_saveable():
    """The remat policy that keeps every matmul output (a function in 0.10, an instance of a
    policy class in 0.11)."""
    policy = jax.checkpoint_policies.dots_saveable
    return policy() if isinstance(policy, type) else policy


def save_from_both_policies(a, b):
    """The remat policy that keeps what either ``a`` or ``b`` keeps."""
    return jax.checkpoint_policies.save_from_both_policies(a, b)


def all_gather_invariant(x: jax.Array, axis_name: str, axis: int) -> jax.Array:
    """Tiled all-gather over ``axis_name`` whose result is typed *invariant* (the same on every
    device): its transpose is each device's slice, not a reduce-scatter. jax 0.10 spells it
    ``lax.all_gather(..., to='invarying')``; a JAX with ``lax.all_gather_invariant`` uses that."""
    fn = getattr(jax.lax, "all_gather_invariant", None)
    if fn is not None:  # pragma: no cover - not in jax 0.10
        return fn(x, axis_name, axis=axis, tiled=True)
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True, to="invarying")

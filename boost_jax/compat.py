"""The few JAX APIs that differ between the CPU machines (jax 0.10.x, Python 3.11) and the GPU
machines (jax 0.11.x), resolved in one place."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np


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


# --- cuDNN attention through JAX's private module (jax._src.cudnn.fused_attention_stablehlo) ---

#: the parameters of the private ``dot_product_attention`` that :func:`cudnn_packed_attention`
#: passes (by keyword); the same in jax 0.10.2, 0.11.2 and 0.12.0.1 (0.12 adds ``score_mod*``)
CUDNN_PACKED_PARAMS = ("query", "key", "value", "q_seqlen", "kv_seqlen", "q_offsets",
                       "kv_offsets", "scale", "mask_type", "qkv_layout")
#: the private functions :func:`cudnn_trace_standin` replaces
CUDNN_TRACE_CHECKS = ("check_cudnn_version", "check_compute_capability")


def _cudnn_module():
    """``jax._src.cudnn.fused_attention_stablehlo``, or a clear error naming this JAX."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError as err:  # pragma: no cover - depends on the JAX version
        raise ImportError(f"jax {jax.__version__} has no jax._src.cudnn.fused_attention_"
                          f"stablehlo (written for jax 0.10.2 to 0.12.0.1): {err}") from err
    return fa


def cudnn_packed_signature_problem() -> str | None:
    """Why :func:`cudnn_packed_attention` cannot call this JAX's private cuDNN attention
    (``None``: it can): a parameter it passes or ``MaskType.PADDING_CAUSAL`` moved."""
    import inspect

    try:
        fa = _cudnn_module()
    except ImportError as err:
        return str(err)
    fn = getattr(fa, "dot_product_attention", None)
    if fn is None:
        return "jax._src.cudnn.fused_attention_stablehlo.dot_product_attention is gone"
    params = inspect.signature(fn).parameters
    missing = [p for p in CUDNN_PACKED_PARAMS if p not in params]
    if missing:
        return (f"jax._src.cudnn.fused_attention_stablehlo.dot_product_attention has no "
                f"parameter {', '.join(missing)}")
    if not hasattr(getattr(fa, "MaskType", None), "PADDING_CAUSAL"):
        return "jax._src.cudnn.fused_attention_stablehlo.MaskType.PADDING_CAUSAL is gone"
    return None


def cudnn_packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, seqlens: jax.Array,
                           offsets: jax.Array, scale: float) -> jax.Array:
    """Causal cuDNN flash attention over packed rows, each row a run of segments attending
    only within themselves (cuDNN's packed, "ragged" layout; needs Hopper or newer).

    JAX has no public API for it: this calls the private
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (checked on jax 0.10.2,
    0.11.2 and 0.12.0.1, where the parameters it passes are the same), and raises a clear
    error where they moved (:func:`cudnn_packed_signature_problem`). Where this JAX
    mis-strides grouped key/value heads (:func:`cudnn_packed_gqa_native`: jax 0.10.2), the
    key/value heads are repeated to the query's.

    Args:
      q: ``[B, T, N, H]`` bf16/f16; k, v: ``[B, T, K, H]`` with ``N % K == 0`` (GQA).
      seqlens: int32 ``[B, M]``: each row's segment lengths, then ``-1``.
      offsets: int32 ``[B, M + 1]``: each row's segment starts (token index in the row), then
        ``-1`` (the last column always ``-1``). ``M``: the static bound on segments per row.
      scale: the logits' scale (``1 / sqrt(H)``).
    Returns:
      ``[B, T, N, H]`` in q's dtype; tokens outside every segment are undefined.
    """
    problem = cudnn_packed_signature_problem()
    if problem is not None:
        raise RuntimeError(f"cuDNN packed attention: {problem} (jax {jax.__version__}; "
                           "written for jax 0.10.2 to 0.12.0.1): use Parallel.attention='xla'")
    fa = _cudnn_module()
    if k.shape[2] != q.shape[2] and not cudnn_packed_gqa_native():
        rep = q.shape[2] // k.shape[2]  # this JAX strides kv offsets by the query's heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    return fa.dot_product_attention(
        query=q, key=k, value=v, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets,
        kv_offsets=offsets, scale=scale, mask_type=fa.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH")


@functools.cache
def cudnn_packed_gqa_native() -> bool:
    """Whether this JAX's packed cuDNN attention strides the key/value segment offsets by the
    key's heads (GQA as is). jax 0.10.2 strides them by the query's (fixed in jax PR #39521,
    in 0.11.2 and 0.12.0.1): a silently wrong result, so :func:`cudnn_packed_attention`
    repeats the key/value heads there. Probed on the private ``_fix_seqlen_offsets`` (2 query
    heads, 1 key head, head dim 8, segments at 0 and 1): ``False`` too where it moved."""
    fix = getattr(_cudnn_module(), "_fix_seqlen_offsets", None)
    if fix is None:
        return False
    lens, offs = np.array([[1, 1]], np.int32), np.array([[0, 1, -1]], np.int32)
    with jax.ensure_compile_time_eval():
        kv_offsets = fix(lens, lens, offs, offs, jnp.zeros((1, 2, 2, 8), jnp.bfloat16),
                         jnp.zeros((1, 2, 1, 8), jnp.bfloat16))[3]
    return int(np.asarray(kv_offsets).ravel()[1]) == 8


@contextlib.contextmanager
def cudnn_trace_standin(cudnn_version: int = 91000):
    """For lowering cuDNN attention for CUDA on a host without cuDNN or a GPU (tests, the
    CUDA-lowered program of analysis/lowered.py): never for running it.

    JAX's cuDNN attention checks at trace time that cuDNN is installed
    (``check_cudnn_version``, which raises "cuDNN is not detected" on a CPU-only jaxlib) and
    the GPU's compute capability (``check_compute_capability``, False without a GPU backend,
    which refuses the packed layout). Inside this context both private functions of
    ``jax._src.cudnn.fused_attention_stablehlo`` answer as a Hopper GPU with cuDNN
    ``cudnn_version`` would; they are restored on exit. Raises AttributeError where this JAX
    has moved them (checked on jax 0.10.2, 0.11.2 and 0.12.0.1).
    """
    fa = _cudnn_module()
    saved = {name: getattr(fa, name) for name in CUDNN_TRACE_CHECKS}  # AttributeError: moved
    fa.check_cudnn_version = lambda: cudnn_version
    fa.check_compute_capability = lambda capability: True
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(fa, name, fn)


# --- manual axis types inside shard_map ---------------------------------------------------------

def varying_axes(x) -> frozenset[str]:
    """The mesh axes ``x`` varies over inside a ``shard_map`` region (empty outside one).

    ``x``: a value (array or tracer) or a ``jax.ShapeDtypeStruct`` (``jax.eval_shape`` inside
    the region keeps the type). jax 0.10.2 to 0.12.0.1: ``jax.typeof(x).manual_axis_type
    .varying`` (older JAX called it ``.vma``); an AttributeError naming this JAX where it
    moved (tests/test_compat.py)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        holder, what = x, "jax.ShapeDtypeStruct"
    else:
        holder, what = jax.typeof(x), "jax.typeof(x)"
    if not hasattr(holder, "manual_axis_type"):
        raise AttributeError(f"jax {jax.__version__}: {what} has no manual_axis_type "
                             "(written for jax 0.10.2 to 0.12.0.1)")
    manual = holder.manual_axis_type
    return frozenset(manual.varying) if manual is not None else frozenset()


# --- XLA's GPU options, per compile (commands/gpu_compile.py) -------------------------------------

def xla_pipelining_options_renamed() -> bool:
    """Whether this jaxlib's XLA takes collective pipelining per compile as
    ``xla_gpu_pipeline_{all_gather,reduce_scatter,all_reduce}`` (an enum,
    ``COLLECTIVE_PIPELINING_MODE_ON``): jaxlib >= 0.11, whose DebugOptions reserve the old
    ``xla_gpu_enable_pipelined_*`` names (XLA_FLAGS still maps them); read from the 0.10.2,
    0.11.2 and 0.12.0.1 libraries (tests/compiled/test_gpu_report.py compiles with them)."""
    return jax.__version_info__ >= (0, 11)


# --- JAX's persistent compilation cache: its monitoring events ----------------------------------

#: the ``jax.monitoring`` events JAX records when its persistent compilation cache serves a
#: compilation or misses (undocumented names, ``jax/_src/compiler.py`` and
#: ``compilation_cache.py``; the same in jax 0.10.2 to 0.12.0.1: tests/test_compat.py)
COMPILATION_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits",
                            "/jax/compilation_cache/cache_misses": "misses"}


# --- orbax-checkpoint's private Zarr v3 metadata and write-spec builders (integrity.py) -----

#: the module that builds the TensorStore specs orbax-checkpoint writes arrays with
ORBAX_TS_UTILS = "orbax.checkpoint._src.serialization.tensorstore_utils"
#: the function through which orbax-checkpoint builds every Zarr v3 array's metadata (its codec
#: chain): checkpointing/integrity.py checks that it still has the zstd codec whose checksum it
#: turns on
ORBAX_ZARR3_BUILDER = (ORBAX_TS_UTILS, "_build_zarr3_metadata")
#: the function through which orbax-checkpoint builds the write spec of every array it saves
#: (jax and numpy arrays alike; ``build_array_write_spec(info, ...)``, ``info.parent_dir`` the
#: directory written): checkpointing/integrity.py wraps it to checksum the chunks of the arrays
#: written
#: under a checkpoint directory of its own
ORBAX_WRITE_SPEC_BUILDER = (ORBAX_TS_UTILS, "build_array_write_spec")
#: the function through which orbax-checkpoint builds the TensorStore key-value store of every
#: array it writes or reads (``build_kvstore_tspec(directory, name=None, *, use_ocdbt, ...)``):
#: it knows local files and ``gs://`` only; checkpointing/storage.py wraps it for ``s3://``
ORBAX_KVSTORE_BUILDER = (ORBAX_TS_UTILS, "build_kvstore_tspec")


def orbax_version() -> str:
    """The installed orbax-checkpoint's version."""
    import orbax.checkpoint as ocp

    return ocp.__version__


def _orbax_private(where: tuple[str, str], what: str = "chunk checksums cannot be installed"):
    """orbax-checkpoint's private ``module.name``, or a one-line RuntimeError naming the
    installed orbax where it moved (and ``what`` that means)."""
    import importlib

    module, name = where
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise RuntimeError(
            f"orbax-checkpoint {orbax_version()} has no {module}.{name} (boost_jax is tested "
            f"with orbax-checkpoint {TESTED['orbax-checkpoint'][0]}); {what}: install a tested "
            "orbax-checkpoint (pyproject.toml)") from None


def orbax_zarr3_builder():
    """orbax-checkpoint's private ``_build_zarr3_metadata(shape, chunk_shape,
    use_compression)``, or a one-line RuntimeError naming the installed orbax where it moved."""
    return _orbax_private(ORBAX_ZARR3_BUILDER)


def orbax_write_spec_builder():
    """orbax-checkpoint's private ``build_array_write_spec(info, arg=None, *, ...)`` (returns
    an ``ArrayWriteSpec`` whose ``json`` is the TensorStore spec orbax opens to write), or a
    one-line RuntimeError naming the installed orbax where it moved."""
    return _orbax_private(ORBAX_WRITE_SPEC_BUILDER)


def set_orbax_write_spec_builder(fn) -> None:
    """Make orbax-checkpoint build every array's write spec with ``fn`` in this process (the
    caller installs it once, under its own lock: checkpointing/integrity.py)."""
    import importlib

    module, name = ORBAX_WRITE_SPEC_BUILDER
    orbax_write_spec_builder()  # the clear error where it moved
    setattr(importlib.import_module(module), name, fn)


def orbax_kvstore_builder():
    """orbax-checkpoint's private ``build_kvstore_tspec(directory, name=None, *, use_ocdbt,
    ...)`` (the TensorStore kvstore spec of an array's directory), or a one-line RuntimeError
    naming the installed orbax where it moved."""
    return _orbax_private(ORBAX_KVSTORE_BUILDER, "checkpoints on s3:// cannot be written")


def set_orbax_kvstore_builder(fn) -> None:
    """Make orbax-checkpoint build every array's kvstore spec with ``fn`` in this process (the
    caller installs it once, under its own lock: checkpointing/storage.py)."""
    import importlib

    module, name = ORBAX_KVSTORE_BUILDER
    orbax_kvstore_builder()  # the clear error where it moved
    setattr(importlib.import_module(module), name, fn)


# --- etils / fsspec and XLA's cost analysis -----------------------------------------------------

def epath_filesystem(path: str):
    """The fsspec filesystem etils' ``epath`` (and so orbax) reaches ``path`` with -- etils'
    private ``backend.fsspec_backend.fs``, the same instance, whose listing cache then sees
    what is moved through it -- or, where an etils lacks it, fsspec's default instance
    (tests/test_compat.py checks the installed etils has it)."""
    try:
        from etils.epath import backend

        return backend.fsspec_backend.fs(path)
    except (ImportError, AttributeError):
        import fsspec

        return fsspec.core.url_to_fs(path)[0]


def strip_protocol(fs, path: str) -> str:
    """``path`` as ``fs`` names its keys (``s3://b/k`` -> ``b/k``): fsspec's
    ``_strip_protocol``, a private classmethod every filesystem has."""
    return fs._strip_protocol(path)


def cost_analysis(compiled) -> dict:
    """XLA's cost analysis of a compiled program as a dict (jax returns a dict, or a list of
    one; nothing for a program compiled for a GPU target on a CPU host: ``{}``)."""
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost) or {}


# --- the versions boost_jax is tested with --------------------------------------------------------

#: ``package: (lowest tested, first untested)``, the ranges pyproject.toml pins for the
#: libraries whose internals this module touches (tests/test_compat.py checks both agree and
#: that the installed versions are inside): jax 0.10.2 (Python 3.11), 0.11.2 (the GPU
#: machines), 0.12.0.1 (Python 3.12 / 3.13); orbax-checkpoint 0.12.8
TESTED = {"jax": ("0.10.2", "0.13"), "orbax-checkpoint": ("0.12.8", "0.13")}


def _release(version: str) -> tuple[int, ...]:
    """``'0.12.0.1'`` -> ``(0, 12, 0, 1)`` (the leading release numbers; ``'0.13.0rc1'`` ->
    ``(0, 13, 0)``)."""
    import re

    return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def untested_versions() -> list[str]:
    """The installed packages of :data:`TESTED` outside their tested range, as
    ``'jax 0.13.0 (tested: >=0.10.2,<0.13)'`` (empty: all inside)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for package, (low, high) in TESTED.items():
        try:
            have = version(package)
        except PackageNotFoundError:
            out.append(f"{package} not installed (tested: >={low},<{high})")
            continue
        if not _release(low) <= _release(have) < _release(high):
            out.append(f"{package} {have} (tested: >={low},<{high})")
    return out

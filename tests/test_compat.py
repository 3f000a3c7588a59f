"""The private JAX names boost_jax/compat.py leans on for cuDNN attention: these fail on a JAX
that moved them (so a newer JAX is caught here, not in a GPU run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fa

from boost_jax import compat
from boost_jax.analysis import lowered

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive


def _attention_grad_text(q, k, v, packed: bool) -> str:
    def loss(q, k, v):
        if packed:
            lens, offs = jnp.array([[3, 5]], jnp.int32), jnp.array([[0, 3, -1]], jnp.int32)
            out = compat.cudnn_packed_attention(q, k, v, lens, offs, scale=0.5)
        else:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    return lowered.cuda_lowered_text(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)


def test_cudnn_trace_standin_lowers_cudnn_attention():
    """The stand-in's private names exist; with it, cuDNN attention (public, and packed) lowers
    for CUDA on this CPU host; without it, it does not; on exit the originals are back."""
    assert all(callable(getattr(fa, name)) for name in compat.CUDNN_TRACE_CHECKS)
    before = [getattr(fa, name) for name in compat.CUDNN_TRACE_CHECKS]
    q = jax.ShapeDtypeStruct((1, 8, 2, 8), jnp.bfloat16)
    with compat.cudnn_trace_standin():
        for packed in (False, True):
            ops = lowered.parse_ops(_attention_grad_text(q, q, q, packed))
            targets = {op.target for op in lowered.custom_calls(ops, "__cudnn$fmha")}
            assert targets == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert [getattr(fa, name) for name in compat.CUDNN_TRACE_CHECKS] == before
    if fa.cuda_versions is None:  # a CPU-only jaxlib: JAX's own check refuses
        with pytest.raises(RuntimeError, match="cuDNN is not detected"):
            _attention_grad_text(q, q, q, False)


def test_cudnn_packed_signature():
    """The private ``dot_product_attention`` takes every parameter the wrapper passes."""
    assert compat.cudnn_packed_signature_problem() is None


def test_cudnn_packed_signature_moved(monkeypatch):
    """A moved signature is a clear error, not a wrong call."""
    monkeypatch.setattr(fa, "dot_product_attention", lambda query, key, value, *, scale: None)
    problem = compat.cudnn_packed_signature_problem()
    assert "no parameter q_seqlen, kv_seqlen, q_offsets, kv_offsets" in problem
    x = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
    lens = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(RuntimeError, match="use Parallel.attention='xla'"):
        compat.cudnn_packed_attention(x, x, x, lens, lens, scale=1.0)


def _fix(n_heads_of_kv: bool):
    """A stand-in ``_fix_seqlen_offsets`` striding kv offsets by the key's or query's heads."""
    def fix(q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key):
        heads = key.shape[2] if n_heads_of_kv else query.shape[2]
        return q_seqlen, kv_seqlen, q_offsets, np.asarray(kv_offsets) * heads * key.shape[3]
    return fix


@pytest.mark.parametrize("native", [True, False])
def test_cudnn_packed_gqa_probe(monkeypatch, native):
    """The probe tells JAX's fixed kv stride (key heads) from the old one (query heads), and
    the private function it probes exists."""
    assert callable(fa._fix_seqlen_offsets)
    compat.cudnn_packed_gqa_native.cache_clear()
    monkeypatch.setattr(fa, "_fix_seqlen_offsets", _fix(native))
    try:
        assert compat.cudnn_packed_gqa_native() is native
    finally:
        compat.cudnn_packed_gqa_native.cache_clear()


def test_cudnn_packed_gqa_repeats_kv_only_where_needed():
    """On this JAX the packed call gets the key heads as they are where its stride is right,
    the query's heads (repeated) where it is not."""
    q = jax.ShapeDtypeStruct((1, 8, 4, 8), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8, 2, 8), jnp.bfloat16)
    with compat.cudnn_trace_standin():
        ops = lowered.parse_ops(_attention_grad_text(q, kv, kv, packed=True))
    (fwd,) = [op for op in ops if op.target == "__cudnn$fmhaSoftmax"]
    heads = 2 if compat.cudnn_packed_gqa_native() else 4
    assert fwd.operands[1].shape == (1, 8, heads, 8)


# --- the other internals compat.py resolves, and the tested versions -------------------------


def _in_region(fn, *args):
    """``fn(*args)`` traced inside a shard_map region over ``data=2 x tensor=4``, the first
    argument split over data, the rest replicated; returns what ``fn`` recorded."""
    from jax.sharding import NamedSharding

    from boost_jax.config import Parallel
    from boost_jax.parallel.mesh import make_mesh

    mesh = make_mesh(Parallel(data=2, tensor=4))
    specs = (jax.P("data"),) + (jax.P(),) * (len(args) - 1)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    seen = {}

    def body(*xs):
        seen.update(fn(*xs))
        return xs[0]

    with jax.set_mesh(mesh):
        jax.jit(jax.shard_map(body, in_specs=specs, out_specs=jax.P("data")))(*args)
    return seen


def test_varying_axes_inside_and_outside_a_region():
    """A value split over data varies over data, a replicated one over nothing, a psum's result
    over nothing; ``jax.eval_shape`` inside the region keeps the type; outside: nothing."""
    def record(x, y):
        return {"x": compat.varying_axes(x), "y": compat.varying_axes(y),
                "psum": compat.varying_axes(jax.lax.psum(x, "data")),
                "shape": compat.varying_axes(jax.eval_shape(lambda v: v * 2, x)),
                "pcast": compat.varying_axes(jax.lax.pcast(y, ("tensor",), to="varying"))}

    seen = _in_region(record, jnp.zeros(8), jnp.zeros(3))
    assert seen == {"x": {"data"}, "y": set(), "psum": set(), "shape": {"data"},
                    "pcast": {"tensor"}}
    assert compat.varying_axes(jnp.zeros(3)) == frozenset()
    assert compat.varying_axes(jax.ShapeDtypeStruct((3,), jnp.float32)) == frozenset()


def test_varying_axes_moved_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(jax, "typeof", lambda x: object())
    with pytest.raises(AttributeError, match=r"jax .*: jax.typeof\(x\) has no manual_axis_type"):
        compat.varying_axes(jnp.zeros(3))


def test_compilation_cache_events(tmp_path):
    """JAX records the events :data:`compat.COMPILATION_CACHE_EVENTS` names: a miss for a new
    program, a hit for the same program after the in-memory caches are cleared (what
    ``compiling ...`` lines of the trainer report, operations/progress.py)."""
    import uuid

    counts = {"hits": 0, "misses": 0}

    def listen(event: str, **kwargs) -> None:
        if event in compat.COMPILATION_CACHE_EVENTS:
            counts[compat.COMPILATION_CACHE_EVENTS[event]] += 1

    salt = uuid.uuid4().int % 2**31  # a program no earlier run has cached
    fn = jax.jit(lambda x: jnp.sin(x) * salt + 1.0)
    assert jax.config.jax_compilation_cache_dir  # tests/conftest.py turns the cache on
    jax.monitoring.register_event_listener(listen)
    try:
        fn(np.ones(4, np.float32)).block_until_ready()
        after_first = dict(counts)
        jax.clear_caches()
        fn(np.ones(4, np.float32)).block_until_ready()
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert after_first == {"hits": 0, "misses": 1}
    assert counts == {"hits": 1, "misses": 1}


def test_orbax_zarr3_builder_builds_what_the_checksum_hook_edits():
    """orbax's private builder exists and gives a sharded array whose chunks are zstd-compressed
    (the codec checkpointing/integrity.py turns the checksum on in); the hook leaves the builder
    itself
    alone (it edits the write specs of its own directories: the next test)."""
    from boost_jax.checkpointing import integrity

    build = compat.orbax_zarr3_builder()
    (zstd,) = integrity._compression(build((8,), (8,), use_compression=True))
    assert zstd["name"] == "zstd" and not zstd.get("configuration", {}).get("checksum")
    integrity.install_chunk_checksums()
    assert compat.orbax_zarr3_builder() is build
    (zstd,) = integrity._compression(build((8,), (8,), True))
    assert not zstd.get("configuration", {}).get("checksum")
    (zstd,) = integrity._compression(integrity.zarr3_metadata([8]))
    assert zstd["configuration"]["checksum"] is True


def _write_spec(directory) -> dict:
    """The TensorStore spec orbax's private builder gives a float32 ``[8]`` array written
    under ``directory`` (Zarr v3, compressed, no OCDBT)."""
    from etils import epath
    from orbax.checkpoint import type_handlers

    info = type_handlers.ParamInfo(name="x", parent_dir=epath.Path(directory), use_zarr3=True,
                                   use_compression=True, is_ocdbt_checkpoint=False)
    return compat.orbax_write_spec_builder()(
        info=info, global_shape=(8,), local_shape=(8,), dtype=np.dtype(np.float32),
        use_ocdbt=False).json


def test_orbax_write_spec_builder_is_what_the_checksum_hook_wraps(tmp_path):
    """orbax's private write-spec builder exists, takes the ParamInfo that says where the array
    goes and gives a spec with zstd-compressed Zarr v3 chunks; with the hook installed, the
    chunks of arrays under a claimed directory are checksummed, nowhere else, and not after the
    claim is given up."""
    from boost_jax.checkpointing import integrity

    def checksum(directory):
        (zstd,) = integrity._compression(integrity._spec_metadata(_write_spec(directory)))
        return zstd.get("configuration", {}).get("checksum", False)

    assert not checksum(tmp_path / "a")
    claim = integrity.ChunkChecksums(tmp_path / "a")
    try:
        assert callable(compat.orbax_write_spec_builder().unwrapped)
        assert checksum(tmp_path / "a" / "3.orbax-checkpoint-tmp-1" / "state")
        assert not checksum(tmp_path / "b") and not checksum(tmp_path / "ab")
        with integrity.chunk_checksums_off():
            assert not claim.arm()
        assert not checksum(tmp_path / "a" / "4")
        assert claim.arm() and checksum(tmp_path / "a" / "4")
    finally:
        claim.release()
    assert not checksum(tmp_path / "a" / "5")


def test_orbax_write_spec_builder_moved_is_a_clear_error(monkeypatch):
    from boost_jax.checkpointing import integrity

    monkeypatch.setattr(compat, "ORBAX_WRITE_SPEC_BUILDER",
                        (compat.ORBAX_TS_UTILS, "_gone_write_spec"))
    with pytest.raises(RuntimeError, match=r"orbax-checkpoint \S+ has no .*\._gone_write_spec"):
        integrity.install_chunk_checksums()


def test_orbax_zarr3_builder_moved_is_a_clear_error(monkeypatch):
    """An orbax without the builder, or with one that builds something else: one line naming
    the installed orbax, no checkpoint written unverified."""
    import importlib

    from boost_jax.checkpointing import integrity

    module, name = compat.ORBAX_ZARR3_BUILDER
    monkeypatch.setattr(compat, "ORBAX_ZARR3_BUILDER", (module, "_gone"))
    with pytest.raises(RuntimeError, match=r"orbax-checkpoint \S+ has no .*\._gone"):
        integrity.install_chunk_checksums()
    monkeypatch.setattr(compat, "ORBAX_ZARR3_BUILDER", (module, name))
    monkeypatch.setattr(importlib.import_module(module), name,
                        lambda *a, **k: {"codecs": [{"name": "bytes"}]})
    with pytest.raises(RuntimeError, match="builds its Zarr v3 metadata differently"):
        integrity.install_chunk_checksums()


def test_installed_versions_are_the_tested_ones_and_pyproject_pins_them():
    """jax and orbax-checkpoint inside compat.TESTED, and pyproject.toml's pins (the
    dependencies and the gpu extra's CUDA jax) the same ranges: a JAX or orbax outside them
    is untested, whatever pip allowed."""
    import re
    import tomllib
    from pathlib import Path

    assert compat.untested_versions() == []
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pins = project["project"]["dependencies"] + project["project"]["optional-dependencies"]["gpu"]
    for package, (low, high) in compat.TESTED.items():
        want = f">={low},<{high}"
        found = [p for p in pins if re.match(rf"{re.escape(package)}(\[[\w,]+\])?[<>=]", p)]
        assert found and all(p.endswith(want) for p in found), (package, want, found)


def test_untested_versions_says_which(monkeypatch):
    assert compat._release("0.12.0.1") == (0, 12, 0, 1)
    assert compat._release("0.13.0rc1") == (0, 13, 0)
    monkeypatch.setitem(compat.TESTED, "jax", ("0.1", "0.2"))
    (line,) = compat.untested_versions()
    assert line == f"jax {jax.__version__} (tested: >=0.1,<0.2)"


def test_the_fsspec_reach_of_storage_exists():
    """etils' private ``backend.fsspec_backend.fs`` (the filesystem instance epath and orbax
    use: checkpointing/storage.py moves a damaged step aside through it) is where compat looks, and
    fsspec's ``_strip_protocol`` names keys as storage expects."""
    from etils.epath import backend

    assert callable(backend.fsspec_backend.fs)
    fs = compat.epath_filesystem("s3://bucket/run")  # s3fs: the test extra (no connection)
    assert type(fs).__name__ == "S3FileSystem"
    assert compat.strip_protocol(fs, "s3://bucket/run/3") == "bucket/run/3"


def test_cost_analysis_is_a_dict():
    """XLA's cost analysis read the same way on every jax (a dict, or a list of one)."""
    compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4))).compile()
    assert compat.cost_analysis(compiled)["flops"] > 0

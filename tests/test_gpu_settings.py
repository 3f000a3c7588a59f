"""The GPU run settings: what the launchers export, and who wins when the user sets a value."""

import subprocess
import sys

from boost_jax import gpu_settings


def test_defaults_and_user_values():
    env = gpu_settings.environment({})
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == gpu_settings.MEM_FRACTION
    assert env["XLA_FLAGS"] == gpu_settings.flag_text()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]
    assert "triton_gemm" not in env["XLA_FLAGS"]  # candidates are measured before they are set
    user = {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert gpu_settings.environment(user) == user
    appended = gpu_settings.environment(user, append=True)["XLA_FLAGS"]
    assert appended.startswith(gpu_settings.flag_text()) and appended.endswith(user["XLA_FLAGS"])
    pipeline = gpu_settings.environment({"BOOST_JAX_XLA_PIPELINE": "1"})["XLA_FLAGS"]
    assert "pipeline_parallelism_opt_level" in pipeline
    # the deviceless GPU compile's per-compile options are the launchers' flags
    for env in ({}, {"BOOST_JAX_XLA_PIPELINE": "1"}):
        options = gpu_settings.compiler_options(env)
        assert " ".join(f"--{k}={v}" for k, v in options.items()) == (
            gpu_settings.environment(env)["XLA_FLAGS"])


def test_shell_output_and_usage_error():
    done = subprocess.run([sys.executable, "-m", "boost_jax.gpu_settings", "--shell"],
                          capture_output=True, text=True, env={"PATH": ""})
    assert done.returncode == 0
    assert done.stdout.splitlines() == [
        f"export XLA_FLAGS='{gpu_settings.flag_text()}'",
        f"export XLA_PYTHON_CLIENT_MEM_FRACTION={gpu_settings.MEM_FRACTION}"]
    bad = subprocess.run([sys.executable, "-m", "boost_jax.gpu_settings", "--nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_gpu_session_script_keeps_to_its_budget(tmp_path):
    """launch/gpu_session.sh: an unknown stage is a one-line error before anything runs; with
    no time left every command is listed as not started and the results still come back as
    one archive and a summary (the device returns at most 8 files)."""
    import os
    import tarfile
    from pathlib import Path

    script = Path(__file__).parents[1] / "launch" / "gpu_session.sh"
    env = dict(os.environ, PYTHON=sys.executable, BUDGET_S="0")
    bad = subprocess.run(["bash", str(script), "step,nope", str(tmp_path / "bad")],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown stage nope" in bad.stderr
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "out"
    subprocess.run(["bash", str(script), "micro,flags", str(out)], capture_output=True,
                   text=True, env=env, cwd=script.parents[1], check=True)
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.txt"]
    with tarfile.open(out / "results.tgz") as tar:
        skipped = tar.extractfile("results/skipped.txt").read().decode().splitlines()
    candidates = [f for f in gpu_settings.FLAGS_LIST if f.status == "candidate"]
    assert len(skipped) == 2 + len(candidates)  # micro, the baseline, each candidate
    assert all("not started" in line for line in skipped)


def test_gpu_session_runs_the_step_stage_on_cpu(tmp_path):
    """launch/gpu_session.sh step:cola/none for real, at a tiny shape (MODEL_SIZE, LAYERS,
    SEQ_LEN, BATCH, STEPS; XLA's attention) on the CPU without wheels: nvidia-smi (a stand-in)
    names an H200, so the performance model predicts on the h200 profile; device.txt
    (versions, missing modules), the measured row, the prediction and bench.json come back in
    summary.txt and results.tgz, the row's program in hlo.tgz."""
    import json
    import os
    import re
    import tarfile
    from pathlib import Path

    repo = Path(__file__).parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    smi.chmod(0o755)
    env = dict(os.environ, PYTHON=sys.executable, BUDGET_S="240", MODEL_SIZE="tiny",
               LAYERS="2", SEQ_LEN="32", BATCH="2", STEPS="2", ATTENTION="xla",
               SITE=str(tmp_path / "site"), PATH=f"{bin_dir}:{os.environ['PATH']}")
    env.pop("HARDWARE", None)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(repo / "launch" / "gpu_session.sh"), "step:cola/none",
                           str(out)], capture_output=True, text=True, env=env, cwd=repo,
                          timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert "gpu: NVIDIA H200; performance model profile: h200" in summary
    assert "versions: jaxlib " in summary and "missing: " in summary  # device.txt
    assert re.search(r"^btp +cola +\d+\.\d+ +\d+", summary, re.M), summary  # measured
    assert "cola/tiny btp mesh (1, 1, 1) remat=none, batch 2 x 32 on H200-SXM-141GB" in summary
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
        bench = json.load(tar.extractfile("results/step_cola_none/bench.json"))
    assert "results/skipped.txt" not in names
    assert "step_cola_none: exit 0 after " in summary
    with tarfile.open(out / "hlo.tgz") as tar:  # the CoLA row's dumps: autotuning, programs
        assert any(n.endswith("after_optimizations.txt") for n in tar.getnames())
    assert [r["row"] for r in bench["rows"]] == ["btp"] and bench["config"]["Model"]["size"] \
        == "tiny"

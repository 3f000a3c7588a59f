"""Hardware profiles for the performance model: every constant named and sourced.

Bandwidths are per GPU and per direction, in bytes/s; ``peak_flops`` is dense bf16 tensor-core
throughput. Each field can be overridden from the command line (``bench model
--hw_override=field=value``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bw: float  # HBM bytes/s
    hbm_bytes: float  # HBM capacity
    gpus_per_node: int
    intra_bw: float  # NVLink bytes/s per GPU per direction
    inter_bw: float  # network bytes/s per GPU per direction
    intra_latency: float  # s per ring step inside a node
    inter_latency: float  # s per ring step across nodes

    def replace(self, **overrides) -> Hardware:
        return dataclasses.replace(self, **overrides)


PROFILES = {
    # NERSC Perlmutter GPU node (the BOOST paper's machine): 4 x A100-SXM4-80GB.
    "a100_80gb_4gpu": Hardware(
        name="A100-SXM4-80GB, 4 per node (Perlmutter)",
        peak_flops=312e12,  # NVIDIA A100 datasheet: 312 TFLOP/s dense BF16
        hbm_bw=2.039e12,  # A100 80GB SXM datasheet: 2,039 GB/s
        hbm_bytes=80e9,
        gpus_per_node=4,
        intra_bw=300e9,  # third-generation NVLink: 600 GB/s bidirectional per GPU
        inter_bw=25e9,  # Slingshot-11: 4 x 200 Gb/s NICs per node, one per GPU (NERSC docs)
        intra_latency=8e-6,  # NCCL ring step over NVLink, typical small-message latency
        inter_latency=20e-6,  # NCCL ring step over the network, typical
    ),
    "h100_sxm": Hardware(
        name="H100-SXM5-80GB, 8 per node",
        peak_flops=989.4e12,  # NVIDIA H100 SXM datasheet: 989.4 TFLOP/s dense BF16
        hbm_bw=3.35e12,  # H100 SXM datasheet: 3.35 TB/s HBM3
        hbm_bytes=80e9,
        gpus_per_node=8,
        intra_bw=450e9,  # fourth-generation NVLink: 900 GB/s bidirectional per GPU
        inter_bw=50e9,  # one 400 Gb/s NDR InfiniBand NIC per GPU
        intra_latency=6e-6,
        inter_latency=15e-6,
    ),
    "h200": Hardware(
        name="H200-SXM-141GB, 8 per node",
        peak_flops=989.4e12,  # NVIDIA H200 datasheet: same tensor cores as H100 SXM
        hbm_bw=4.8e12,  # H200 datasheet: 4.8 TB/s HBM3e
        hbm_bytes=141e9,
        gpus_per_node=8,
        intra_bw=450e9,  # NVLink 4: 900 GB/s bidirectional per GPU
        inter_bw=50e9,  # one 400 Gb/s NDR InfiniBand NIC per GPU
        intra_latency=6e-6,
        inter_latency=15e-6,
    ),
}

"""The ROCm plugin: description, a probe that stays cheap, KFD topology parsing and gfx-target features.

KFD trees are written under ``tmp_path`` with the key names the amdgpu driver prints
(drivers/gpu/drm/amd/amdkfd/kfd_topology.c) and values of real boards.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from vllm_port import PlatformDescription
from vllm_port.platform import validate_description, validate_probe
from vllm_port.plugin_kit import DeviceAllocator
from vllm_port_rocm import plugin
from vllm_port_rocm.platform import (
    KfdGpu,
    arch_capabilities,
    describe,
    gfx_arch,
    parse_properties,
    probe,
    read_kfd_gpus,
    select_visible,
)

CPU_TORCH = torch.version.cuda is None and torch.version.hip is None
GIB = 2**30


def write_node(
    root: Path, node: int, props: dict[str, int], banks: Sequence[tuple[int, int]] = (), product: str = ""
) -> None:
    """Write KFD node ``node`` under ``root`` (a sysfs root): its properties, (heap_type, bytes) banks, product name."""
    node_dir = root / "class/kfd/kfd/topology/nodes" / str(node)
    node_dir.mkdir(parents=True)
    (node_dir / "properties").write_text("".join(f"{k} {v}\n" for k, v in props.items()))
    (node_dir / "gpu_id").write_text("0\n" if not props.get("gfx_target_version") else f"{4000 + node}\n")
    for i, (heap_type, size) in enumerate(banks):
        bank = node_dir / "mem_banks" / str(i)
        bank.mkdir(parents=True)
        (bank / "properties").write_text(
            f"heap_type {heap_type}\nsize_in_bytes {size}\nflags 0\nwidth 8192\nmem_clk_max 2600\n"
        )
    if product:
        device = root / f"class/drm/renderD{props['drm_render_minor']}/device"
        device.mkdir(parents=True)
        (device / "product_name").write_text(product + "\n")


def cpu_node(root: Path) -> None:
    write_node(
        root,
        0,
        {"cpu_cores_count": 96, "simd_count": 0, "mem_banks_count": 1, "gfx_target_version": 0, "vendor_id": 0},
        banks=[(0, 1536 * GIB)],  # system memory: heap_type 0
    )


def mi300x_node(root: Path, node: int, minor: int) -> None:
    # MI300X: gfx942, 304 CUs (1216 SIMDs, 4 per CU), 192 GiB of HBM3, 64-wide wavefronts.
    props = {
        "cpu_cores_count": 0, "simd_count": 1216, "mem_banks_count": 1, "wave_front_size": 64, "array_count": 32,
        "simd_arrays_per_engine": 1, "cu_per_simd_array": 10, "simd_per_cu": 4, "gfx_target_version": 90402,
        "vendor_id": 4098, "device_id": 29857, "drm_render_minor": minor, "local_mem_size": 0, "num_xcc": 8,
    }  # fmt: skip
    write_node(root, node, props, banks=[(1, 192 * GIB)], product="AMD Instinct MI300X")


def test_describe_is_valid_and_uses_the_cuda_device_type() -> None:
    d = validate_description(describe())
    assert (d.name, d.device_type, d.priority, d.dist_backend) == ("rocm", "cuda", 100, "nccl")
    assert d.graph_capture is True
    assert d.memory_tiers == ("device", "pinned_host")


@pytest.mark.skipif(not CPU_TORCH, reason="asserts the reason a CPU build of torch gives")
def test_probe_on_cpu_torch_says_how_to_fix() -> None:
    result = validate_probe(probe())
    assert result.available is False
    assert result.reason == (
        f"torch {torch.__version__} has no ROCm support (torch.version.hip is None); install a ROCm build of torch"
    )


@pytest.mark.slow
def test_probe_creates_no_device_context() -> None:
    code = textwrap.dedent("""
        import torch
        from vllm_port.platform import validate_probe
        from vllm_port_rocm import plugin
        validate_probe(plugin.vllm_port_platform_probe())
        print(torch.cuda.is_initialized(), plugin.vllm_port_platform_context_created())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_probe_on_cuda_torch_points_to_the_cuda_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    result = validate_probe(probe())
    assert result.available is False
    assert result.reason.startswith(f"torch {torch.__version__} is a CUDA 12.8 build")
    assert "vllm-port-cuda" in result.reason


@pytest.mark.parametrize(
    ("version", "arch"),
    [(90402, "gfx942"), (90010, "gfx90a"), (90008, "gfx908"), (90500, "gfx950"), (100300, "gfx1030"),
     (110000, "gfx1100"), (110501, "gfx1151"), (120001, "gfx1201")],
)  # fmt: skip
def test_gfx_arch_decodes_kfd_target_versions(version: int, arch: str) -> None:
    assert gfx_arch(version) == arch


@pytest.mark.parametrize(
    ("arch", "wavefront", "matrix_cores", "fp8"),
    [
        ("gfx906", 64, "none", "none"),  # MI50: GCN, dot instructions only
        ("gfx908", 64, "mfma", "none"),  # MI100
        ("gfx90a", 64, "mfma", "none"),  # MI210/MI250X
        ("gfx942", 64, "mfma", "fnuz"),  # MI300X/MI325X
        ("gfx950", 64, "mfma", "ocp"),  # MI350X/MI355X
        ("gfx1030", 32, "none", "none"),  # RDNA2
        ("gfx1100", 32, "wmma", "none"),  # RDNA3
        ("gfx1201", 32, "wmma", "ocp"),  # RDNA4
    ],
)
def test_arch_capabilities_follow_amd_isa_references(arch: str, wavefront: int, matrix_cores: str, fp8: str) -> None:
    assert arch_capabilities(arch) == {
        "gfx_arch": arch,
        "wavefront_size": wavefront,
        "matrix_cores": matrix_cores,
        "fp8": fp8,
    }


def test_parse_properties_keeps_integer_lines() -> None:
    text = "cpu_cores_count 0\nsimd_count 1216\nhive_id 11638818706288400384\n\ngarbage\n"
    assert parse_properties(text) == {"cpu_cores_count": 0, "simd_count": 1216, "hive_id": 11638818706288400384}


def test_read_kfd_gpus_skips_cpus_and_sums_framebuffer_banks(tmp_path: Path) -> None:
    cpu_node(tmp_path)
    mi300x_node(tmp_path, 1, 128)
    # RX 7900 XTX: gfx1100, 96 CUs (2 SIMDs each), 24 GiB less the driver's reserve; no product_name file.
    rdna3 = {
        "cpu_cores_count": 0,
        "simd_count": 192,
        "simd_per_cu": 2,
        "gfx_target_version": 110000,
        "drm_render_minor": 129,
    }
    write_node(tmp_path, 2, rdna3, banks=[(1, 25753026560), (0, 4 * GIB)])
    assert read_kfd_gpus(str(tmp_path)) == [
        KfdGpu(node=1, arch="gfx942", name="AMD Instinct MI300X", memory=192 * GIB, compute_units=304),
        KfdGpu(node=2, arch="gfx1100", name="AMD gfx1100", memory=25753026560, compute_units=96),
    ]


def test_read_kfd_gpus_falls_back_to_local_mem_size(tmp_path: Path) -> None:
    write_node(
        tmp_path, 0, {"gfx_target_version": 90010, "simd_count": 440, "simd_per_cu": 4, "local_mem_size": 64 * GIB}
    )
    assert read_kfd_gpus(str(tmp_path)) == [KfdGpu(0, "gfx90a", "AMD gfx90a", 64 * GIB, 110)]


def test_read_kfd_gpus_without_kfd_is_empty(tmp_path: Path) -> None:
    assert read_kfd_gpus(str(tmp_path)) == []


def test_select_visible_follows_the_runtime() -> None:
    gpus = ["g0", "g1", "g2", "g3"]
    assert select_visible(gpus, None) == gpus
    assert select_visible(gpus, "2,0") == ["g2", "g0"]
    assert select_visible(gpus, "1,9,2") == ["g1"]  # stops at the index out of range
    assert select_visible(gpus, "") == []
    assert select_visible(gpus, "GPU-4c3a1b2f,GPU-77e0") == gpus  # UUIDs: cannot tell which, keep all


@pytest.fixture
def hip_torch(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Make torch look like a ROCm 6.4 build, with no visibility variables set."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", None)
    for name in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_probe_with_gpus_reads_the_topology(hip_torch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu_node(tmp_path)
    mi300x_node(tmp_path, 1, 128)
    mi300x_node(tmp_path, 2, 136)
    hip_torch.setattr(torch.cuda, "device_count", lambda: 2)
    result = validate_probe(probe(str(tmp_path)))
    assert result.available is True
    assert [(d.name, d.total_memory, d.arch) for d in result.devices] == [
        ("AMD Instinct MI300X", 192 * GIB, "gfx942")
    ] * 2
    assert result.capabilities == {
        "hip_version": "6.4.43482", "gfx_arch": "gfx942", "wavefront_size": 64, "matrix_cores": "mfma", "fp8": "fnuz",
        "compute_units": 304, "aiter_installed": False,
        "triton_installed": importlib.util.find_spec("triton") is not None,
    }  # fmt: skip
    assert (
        result.reason
        == f"2 AMD GPU(s) visible to torch {torch.__version__} (HIP 6.4.43482): 2x AMD Instinct MI300X (gfx942)"
    )


def test_probe_applies_hip_visible_devices(hip_torch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mi300x_node(tmp_path, 1, 128)
    write_node(
        tmp_path, 2, {"gfx_target_version": 110000, "simd_count": 192, "simd_per_cu": 2}, banks=[(1, 25753026560)]
    )
    hip_torch.setenv("HIP_VISIBLE_DEVICES", "1")
    hip_torch.setattr(torch.cuda, "device_count", lambda: 1)
    result = validate_probe(probe(str(tmp_path)))
    assert [d.arch for d in result.devices] == ["gfx1100"]
    assert result.capabilities["wavefront_size"] == 32


def test_probe_without_topology_names_devices_generically(hip_torch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hip_torch.setattr(torch.cuda, "device_count", lambda: 1)
    result = validate_probe(probe(str(tmp_path)))
    assert result.available is True
    assert result.devices[0].name == "AMD GPU 0"
    assert "read at bind" in result.reason


def test_probe_without_visible_gpu_says_what_to_check(hip_torch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hip_torch.setattr(torch.cuda, "device_count", lambda: 0)
    topology = tmp_path / "class/kfd/kfd/topology/nodes"
    build = f"torch {torch.__version__} (HIP 6.4.43482)"
    assert validate_probe(probe(str(tmp_path))).reason == (
        f"{build} sees no AMD GPU and {topology} lists none; load the amdgpu driver (modprobe amdgpu), "
        "or pass /dev/kfd and /dev/dri into the container"
    )
    mi300x_node(tmp_path, 1, 128)
    hip_torch.setenv("HIP_VISIBLE_DEVICES", "3")
    assert validate_probe(probe(str(tmp_path))).reason == (
        f"{build} sees no AMD GPU although {topology} lists 1 (gfx942); check that HIP_VISIBLE_DEVICES='3' names "
        "GPUs that rocm-smi lists, and that this user can open /dev/kfd and /dev/dri/renderD* (groups video and render)"
    )


def test_allocator_only_for_the_rocm_platform() -> None:
    before = torch.cuda.is_initialized()
    allocator = plugin.vllm_port_allocator(describe())
    assert type(allocator) is DeviceAllocator and allocator.name == "rocm allocator"
    assert allocator.device.type == "cuda" and allocator.torch_device == "cuda"
    assert plugin.vllm_port_allocator(PlatformDescription("cuda", "cuda", 100, "nccl")) is None
    assert torch.cuda.is_initialized() == before  # building it touches no device


@pytest.mark.slow
def test_the_triton_target_is_plain_data_that_imports_without_triton() -> None:
    # Triton is no declared dependency (torch's ROCm wheels bring it): the plugin's modules import without it.
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes ``import triton`` raise ImportError
        from vllm_port_rocm.triton_targets import ROCM
        print(ROCM.name)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["rocm"]

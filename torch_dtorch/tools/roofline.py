"""Roofline report: per-operator FLOPs and bytes (from each operator's ``OperatorCost``), device peaks, and the
estimated time of every operator under the roofline model ``max(FLOPs / peak FLOP/s, bytes / peak bandwidth)``.

Costs are global (the whole mesh's work); an operator's estimate assumes its work splits evenly over the devices it
runs on (``AssignInfo.devices``). An operator is *compute-bound* when its arithmetic intensity (FLOPs per byte)
exceeds the device's ridge point ``peak FLOP/s / bandwidth``, else *memory-bound*. Redistributes are listed with
their communication bytes over ``DevicePeaks.link_bw`` (*comm*).

Peaks: CUDA devices are matched by name against a table (A100, H100, H200; dense tensor-core numbers for 16-bit
types, TF32 or FP32 otherwise), unknown GPUs and the CPU are measured with a quick probe (a matmul and a copy).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch_dtorch.graph import LogicalGraph, Operator

__all__ = ["DevicePeaks", "OpEstimate", "RooflineReport", "device_peaks", "measure_peaks", "roofline"]

log = logging.getLogger(__name__)

_T = 1e12


@dataclass(frozen=True)
class DevicePeaks:
    """Peak throughput of one device: FLOP/s per dtype class (``"16bit"``, ``"fp32"``), memory and link bandwidth
    (bytes/s)."""

    name: str
    flops: dict[str, float]
    mem_bw: float
    link_bw: float = 0.0

    def flops_for(self, dtype: torch.dtype | None) -> float:
        key = "16bit" if dtype in (torch.float16, torch.bfloat16) else "fp32"
        return self.flops.get(key) or max(self.flops.values())

    def ridge(self, dtype: torch.dtype | None = None) -> float:
        """Arithmetic intensity (FLOP/byte) where the compute and memory roofs meet."""
        return self.flops_for(dtype) / self.mem_bw


#: dense peaks from the vendors' data sheets (SXM parts; fp32 = TF32 tensor cores, which torch uses for matmuls
#: only with ``torch.backends.cuda.matmul.allow_tf32``; the plain FP32 pipe is listed as ``fp32_simt``)
GPU_TABLE: dict[str, DevicePeaks] = {
    "H200": DevicePeaks("H200", {"16bit": 989 * _T, "fp32": 494 * _T, "fp32_simt": 67 * _T}, 4.8e12, 450e9),
    "H100": DevicePeaks("H100", {"16bit": 989 * _T, "fp32": 494 * _T, "fp32_simt": 67 * _T}, 3.35e12, 450e9),
    "A100": DevicePeaks(
        "A100", {"16bit": 312 * _T, "fp32": 156 * _T, "fp32_simt": 19.5 * _T}, 2.039e12, 300e9
    ),
}


def measure_peaks(device: str | torch.device = "cpu", *, size: int = 256, copy_mib: int = 32) -> DevicePeaks:
    """A quick probe (well under a second): the best of a few ``size``³ matmuls and ``copy_mib`` MiB copies."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    src = torch.empty(copy_mib * 2**18, device=device)
    dst = torch.empty_like(src)

    def best(fn: Any, reps: int = 5) -> float:
        fn()
        sync()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return max(min(times), 1e-9)

    flops = 2 * size**3 / best(lambda: torch.mm(a, b))
    bw = 2 * src.numel() * src.element_size() / best(lambda: dst.copy_(src))
    name = f"{device.type} (measured)"
    return DevicePeaks(name, {"fp32": flops, "16bit": flops}, bw, link_bw=bw)  # in-memory collectives copy


def device_peaks(device: str | torch.device | None = None) -> DevicePeaks:
    """Peaks of ``device`` (default: cuda:0 if available, else the CPU): from :data:`GPU_TABLE` for a known GPU,
    else measured."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        for key, peaks in GPU_TABLE.items():
            if key in props.name:
                return peaks
        log.info("roofline: %s is not in the peak table; measuring", props.name)
    return measure_peaks(device)


@dataclass(frozen=True)
class OpEstimate:
    """One operator under the roofline model."""

    index: int
    name: str
    line: str
    flops: int
    bytes: int
    comm_bytes: int
    num_devices: int
    dtype: torch.dtype | None
    time_s: float
    bound: str  # "compute", "memory", "comm" or "free"

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


@dataclass
class RooflineReport:
    peaks: DevicePeaks
    ops: list[OpEstimate] = field(default_factory=list)

    @property
    def total_time_s(self) -> float:
        return sum(o.time_s for o in self.ops)

    def top(self, n: int = 10) -> list[OpEstimate]:
        return sorted(self.ops, key=lambda o: o.time_s, reverse=True)[:n]

    def by_name(self) -> list[tuple[str, int, float, int, int]]:
        """(op name, count, total time, total FLOPs, total bytes), slowest first."""
        acc: dict[str, list[float]] = {}
        for o in self.ops:
            a = acc.setdefault(o.name, [0, 0.0, 0, 0])
            a[0] += 1
            a[1] += o.time_s
            a[2] += o.flops
            a[3] += o.bytes + o.comm_bytes
        rows = [(k, int(v[0]), v[1], int(v[2]), int(v[3])) for k, v in acc.items()]
        return sorted(rows, key=lambda r: r[2], reverse=True)

    def table(self, n: int = 10) -> str:
        total = self.total_time_s or 1.0
        p = self.peaks
        lines = [
            f"roofline on {p.name}: {p.flops_for(None) / _T:.3g} TFLOP/s fp32, {p.flops_for(torch.float16) / _T:.3g} "
            f"TFLOP/s 16-bit, {p.mem_bw / 1e9:.3g} GB/s memory; ridge {p.ridge():.3g} FLOP/B (fp32)",
            f"{len(self.ops)} operators, estimated {self.total_time_s * 1e6:.4g} us in total; top {n}:",
            f"{'#':>4}  {'op':<36}{'GFLOP':>10}{'MB':>10}{'FLOP/B':>9}{'est. us':>10}{'share':>7}  bound",
        ]
        for o in self.top(n):
            ai = f"{o.intensity:.3g}" if o.bytes else "-"
            mb = (o.bytes + o.comm_bytes) / 1e6
            lines.append(
                f"{o.index:>4}  {o.name[:36]:<36}{o.flops / 1e9:>10.4g}{mb:>10.4g}{ai:>9}"
                f"{o.time_s * 1e6:>10.4g}{o.time_s / total:>7.1%}  {o.bound}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def save_png(self, path: str | Path, *, title: str = "dtorch roofline") -> Path:
        """Roofs (compute per dtype class, memory) and every operator at (intensity, estimated FLOP/s per device)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        p = self.peaks
        fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
        pts = [o for o in self.ops if o.flops and o.bytes and o.time_s > 0]
        lo = min([o.intensity for o in pts] + [0.1]) / 2
        hi = max([o.intensity for o in pts] + [p.ridge(torch.float16) * 4])
        xs = [lo, hi]
        for key, style in (("fp32", "-"), ("16bit", "--")):
            peak = p.flops.get(key)
            if peak:
                ax.plot(
                    xs, [min(peak, x * p.mem_bw) for x in xs], "k" + style, linewidth=1, label=f"roof {key}"
                )
        ridge = p.ridge()
        ax.plot([lo, ridge, hi], [lo * p.mem_bw, p.flops_for(None), p.flops_for(None)], "k-", linewidth=1)
        names = sorted({o.name for o in pts})
        cmap = plt.get_cmap("tab10")
        for i, name in enumerate(names):
            sel = [o for o in pts if o.name == name]
            ax.scatter(
                [o.intensity for o in sel],
                [o.flops / o.num_devices / o.time_s for o in sel],
                s=18, color=cmap(i % 10), label=name.removeprefix("aten."), zorder=3,
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("FLOP/s per device (estimated)")
        ax.set_title(f"{title} ({p.name})")
        ax.legend(fontsize="x-small", loc="lower right")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path


def roofline(
    graph: LogicalGraph | Iterable[Operator], *, peaks: DevicePeaks | None = None, device: str | None = None
) -> RooflineReport:
    """Estimate every operator of ``graph`` (a LogicalGraph, a GraphRecorder's ``graph``, or operators)."""
    from torch_dtorch.graph.printer import format_operator

    peaks = peaks if peaks is not None else device_peaks(device)
    report = RooflineReport(peaks)
    nodes = graph.operators if isinstance(graph, LogicalGraph) else list(graph)
    for i, node in enumerate(nodes):
        c = node.cost
        n = max(len(node.assign.devices), 1) if node.assign is not None else 1
        dtype = node.outputs[0].dtype if node.outputs else None
        t_compute = c.flops / n / peaks.flops_for(dtype)
        t_memory = c.bytes / n / peaks.mem_bw
        t_comm = c.comm_bytes / n / peaks.link_bw if peaks.link_bw else 0.0
        t = max(t_compute, t_memory, t_comm)
        if t == 0:
            bound = "free"
        elif t == t_comm:
            bound = "comm"
        else:
            bound = "compute" if t_compute >= t_memory else "memory"
        report.ops.append(
            OpEstimate(
                i, node.name, format_operator(node), c.flops, c.bytes, c.comm_bytes, n, dtype, t, bound
            )
        )
    return report

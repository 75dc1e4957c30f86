"""Honest, stateful fakes of the GPU memory mechanisms the enforcement backends drive.

Each reads only what the real mechanism reads (environment of the process, files on disk) and
keeps device state: an allocation beyond a cap fails, a soft-limit holder is evicted first."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1024 * 1024
_UNITS = {"": 1, "b": 1, "k": 1024, "m": MIB, "g": 1024 * MIB}


class OutOfMemory(Exception):
    pass


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[bB]?\s*", text)
    if not m:
        raise ValueError(f"bad size {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass
class FakeDevice:
    total: int
    used: dict[str, int] = field(default_factory=dict)  # owner -> bytes

    def free(self) -> int:
        return self.total - sum(self.used.values())


# ----------------------------------------------------------------------------------- MPS
class FakeMpsDaemon:
    """nvidia-cuda-mps-control: a control pipe in its pipe directory, a default pinned limit and
    per-client limits set through the control commands; clients are processes whose environment
    names its pipe directory."""

    def __init__(self, pipe_dir: Path, device: FakeDevice):
        self.pipe_dir, self.device = Path(pipe_dir), device
        self.default_limit: int | None = None
        self.pid_limits: dict[int, int] = {}

    def start(self) -> None:
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        (self.pipe_dir / "control").touch()

    def stop(self) -> None:
        (self.pipe_dir / "control").unlink()

    def control(self, command: str) -> None:
        words = command.split()
        if words[0] == "set_default_device_pinned_mem_limit":
            self.default_limit = parse_size(words[2])
        elif words[0] == "set_device_pinned_mem_limit":
            self.pid_limits[int(words[1])] = parse_size(words[3])
        else:
            raise ValueError(f"unknown control command {words[0]}")

    def client(self, pid: int, env: dict[str, str]) -> "FakeCudaProcess":
        if env.get("CUDA_MPS_PIPE_DIRECTORY") != str(self.pipe_dir) or not (self.pipe_dir / "control").exists():
            return FakeCudaProcess(f"pid{pid}", self.device, None)  # not an MPS client: CUDA ignores the limit
        limits = [lim for lim in (self.default_limit, self.pid_limits.get(pid)) if lim is not None]
        raw = env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
        for item in filter(None, raw.split(",")):
            dev, size = item.split("=")
            if dev == "0":
                limits.append(parse_size(size))
        return FakeCudaProcess(f"pid{pid}", self.device, min(limits) if limits else None)


@dataclass
class FakeCudaProcess:
    owner: str
    device: FakeDevice
    limit: int | None
    used: int = 0

    def malloc(self, n: int) -> None:
        if self.limit is not None and self.used + n > self.limit:
            raise OutOfMemory(f"{self.owner}: {self.used + n} > limit {self.limit}")
        if n > self.device.free():
            raise OutOfMemory(f"{self.owner}: device full")
        self.used += n
        self.device.used[self.owner] = self.used


# ----------------------------------------------------------------------------------- HAMi-core
class FakeHamiLibrary:
    """libvgpu.so: intercepts cudaMalloc when preloaded, caps each device at
    CUDA_DEVICE_MEMORY_LIMIT_<i> (or CUDA_DEVICE_MEMORY_LIMIT), and counts the usage of all
    processes sharing CUDA_DEVICE_MEMORY_SHARED_CACHE in that file."""

    def __init__(self, library: Path, device: FakeDevice):
        self.library, self.device = Path(library), device

    def process(self, pid: int, env: dict[str, str]) -> "FakeHamiProcess":
        preloaded = str(self.library) in env.get("LD_PRELOAD", "").split(":") and self.library.is_file()
        raw = env.get("CUDA_DEVICE_MEMORY_LIMIT_0") or env.get("CUDA_DEVICE_MEMORY_LIMIT")
        limit = parse_size(raw) if preloaded and raw else None
        cache = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]) if preloaded and "CUDA_DEVICE_MEMORY_SHARED_CACHE" in env \
            else None
        return FakeHamiProcess(pid, self.device, limit, cache)


@dataclass
class FakeHamiProcess:
    pid: int
    device: FakeDevice
    limit: int | None
    cache: Path | None

    def _shared(self) -> dict[str, int]:
        return json.loads(self.cache.read_text()) if self.cache and self.cache.exists() else {}

    def malloc(self, n: int) -> None:
        shared = self._shared()
        total = sum(shared.values()) if self.cache else self.device.used.get(f"hami{self.pid}", 0)
        if self.limit is not None and total + n > self.limit:
            raise OutOfMemory(f"hami pid {self.pid}: {total + n} > limit {self.limit}")
        if n > self.device.free():
            raise OutOfMemory("device full")
        key = f"hami{self.pid}"
        self.device.used[key] = self.device.used.get(key, 0) + n
        if self.cache:
            shared[str(self.pid)] = shared.get(str(self.pid), 0) + n
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            self.cache.write_text(json.dumps(shared))


# ----------------------------------------------------------------------------------- cgroup dmem
class FakeDmemTree:
    """A cgroup v2 tree with the dmem controller: dmem.capacity lists the regions; a cgroup's
    dmem.max is a hard cap ("<region> <bytes>"), dmem.low its protection. When the device is full,
    memory of cgroups above their low is evicted (to host) first, the largest excess first; a
    charge that eviction cannot make room for fails."""

    def __init__(self, root: Path, region: str, total: int, with_dmem: bool = True):
        self.root, self.region, self.total = Path(root), region, total
        self.usage: dict[str, int] = {}
        self.evicted: dict[str, int] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "cgroup.controllers").write_text("cpuset cpu io memory pids" + (" dmem" if with_dmem else "") + "\n")
        if with_dmem:
            (self.root / "dmem.capacity").write_text(f"{region} {total}\n")

    def _value(self, cg: str, name: str, default: int) -> int:
        try:
            for line in (self.root / cg / name).read_text().splitlines():
                reg, val = line.split()
                if reg == self.region:
                    return default if val == "max" else int(val)
        except FileNotFoundError:
            pass
        return default

    def charge(self, cg: str, n: int) -> None:
        used = self.usage.get(cg, 0)
        if used + n > self._value(cg, "dmem.max", self.total):
            raise OutOfMemory(f"{cg}: over dmem.max")
        need = n - (self.total - sum(self.usage.values()))
        if need > 0:
            excess = sorted(((self.usage[c] - self._value(c, "dmem.low", 0), c) for c in self.usage if c != cg),
                            reverse=True)
            plan = []
            for ex, c in excess:
                if need <= 0 or ex <= 0:
                    break
                plan.append((c, min(ex, need)))
                need -= plan[-1][1]
            if need > 0:  # protected memory (below low) is never taken
                raise OutOfMemory(f"{cg}: device full, nothing above its low left to evict")
            for c, take in plan:
                self.usage[c] -= take
                self.evicted[c] = self.evicted.get(c, 0) + take
        self.usage[cg] = used + n

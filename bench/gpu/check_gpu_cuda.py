"""The GPU check's CUDA side: the one PTX kernel (sum64) and a thin ctypes wrapper over the CUDA
driver API (libcuda.so.1; no toolkit, no PyTorch), used by the check's steps and its child processes."""
from __future__ import annotations

import ctypes
import os
from typing import Any

# --------------------------------------------------------------------------- PTX

KERNEL_NAME = "sum64"
# sum64(src, n_words, out): a grid-stride loop; thread t adds src[t], src[t + stride], ... (u64,
# wrapping) and stores its sum at out[t]. The host adds out[] to check the kernel read everything.
PTX_HEADER = """
.version {version}
.target {target}
.address_size 64
"""
PTX_BODY = r"""
.visible .entry sum64(
    .param .u64 p_src,
    .param .u64 p_n,
    .param .u64 p_out
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_src];
    ld.param.u64 %rd2, [p_n];
    ld.param.u64 %rd3, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ntid.x;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    cvt.u64.u32 %rd4, %r1;
    cvt.u64.u32 %rd5, %r2;
    cvt.u64.u32 %rd6, %r3;
    cvt.u64.u32 %rd7, %r4;
    mul.lo.u64 %rd8, %rd4, %rd5;
    add.u64 %rd8, %rd8, %rd6;
    mul.lo.u64 %rd9, %rd4, %rd7;
    mov.u64 %rd10, 0;
    mov.u64 %rd11, %rd8;
LOOP:
    setp.ge.u64 %p1, %rd11, %rd2;
    @%p1 bra DONE;
    shl.b64 %rd12, %rd11, 3;
    add.u64 %rd13, %rd1, %rd12;
    ld.global.u64 %rd14, [%rd13];
    add.u64 %rd10, %rd10, %rd14;
    add.u64 %rd11, %rd11, %rd9;
    bra LOOP;
DONE:
    shl.b64 %rd12, %rd8, 3;
    add.u64 %rd13, %rd3, %rd12;
    st.global.u64 [%rd13], %rd10;
    ret;
}
"""


def ptx_text(version: str = "6.0", target: str = "sm_50") -> str:
    return PTX_HEADER.format(version=version, target=target) + PTX_BODY


PTX = ptx_text()
# Tried in order: the oldest ISA any driver JITs, then the device's own architecture (a driver
# that no longer takes sm_50 PTX still takes PTX written for the GPU it drives).
PTX_VARIANTS = (("6.0", "sm_50"), ("7.8", "sm_{cc}"), ("8.6", "sm_{cc}"))

FILL_BYTE = 0x01
FILL_WORD = int.from_bytes(bytes([FILL_BYTE]) * 8, "little")


def expected_sum(n_words: int) -> int:
    """What sum64 over ``n_words`` words of FILL_BYTE adds up to (mod 2**64)."""
    return (FILL_WORD * n_words) % (1 << 64)


# --------------------------------------------------------------------------- CUDA driver API


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


CUDA_ERROR_OUT_OF_MEMORY = 2
CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02
ATTR_MULTIPROCESSOR_COUNT = 16
ATTR_CAN_MAP_HOST_MEMORY = 19
ATTR_PCI_BUS_ID = 33
ATTR_CC_MAJOR = 75
ATTR_CC_MINOR = 76


def libcuda_path() -> str:
    return os.environ.get("SWAPAWARE_LIBCUDA", "libcuda.so.1")


class Cuda:
    """Thin ctypes wrapper over the driver API calls this script uses."""

    def __init__(self, path: str | None = None) -> None:
        self.lib = ctypes.CDLL(path or libcuda_path())  # OSError when there is no driver
        u64, c = ctypes.c_uint64, ctypes
        sig = {
            "cuInit": [c.c_uint], "cuDriverGetVersion": [c.POINTER(c.c_int)],
            "cuDeviceGetCount": [c.POINTER(c.c_int)], "cuDeviceGet": [c.POINTER(c.c_int), c.c_int],
            "cuDeviceGetName": [c.c_char_p, c.c_int, c.c_int],
            "cuDeviceTotalMem_v2": [c.POINTER(c.c_size_t), c.c_int],
            "cuDeviceGetAttribute": [c.POINTER(c.c_int), c.c_int, c.c_int],
            "cuDevicePrimaryCtxRetain": [c.POINTER(c.c_void_p), c.c_int],
            "cuDevicePrimaryCtxRelease_v2": [c.c_int],
            "cuCtxSetCurrent": [c.c_void_p], "cuCtxSynchronize": [],
            "cuMemGetInfo_v2": [c.POINTER(c.c_size_t), c.POINTER(c.c_size_t)],
            "cuMemAlloc_v2": [c.POINTER(u64), c.c_size_t], "cuMemFree_v2": [u64],
            "cuMemsetD8_v2": [u64, c.c_ubyte, c.c_size_t],
            "cuMemHostAlloc": [c.POINTER(c.c_void_p), c.c_size_t, c.c_uint], "cuMemFreeHost": [c.c_void_p],
            "cuMemHostGetDevicePointer_v2": [c.POINTER(u64), c.c_void_p, c.c_uint],
            "cuMemcpyHtoD_v2": [u64, c.c_void_p, c.c_size_t], "cuMemcpyDtoH_v2": [c.c_void_p, u64, c.c_size_t],
            "cuModuleLoadData": [c.POINTER(c.c_void_p), c.c_char_p],
            "cuModuleGetFunction": [c.POINTER(c.c_void_p), c.c_void_p, c.c_char_p],
            "cuLaunchKernel": [c.c_void_p, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint,
                               c.c_void_p, c.POINTER(c.c_void_p), c.POINTER(c.c_void_p)],
            "cuGetErrorName": [c.c_int, c.POINTER(c.c_char_p)],
        }
        for name, args in sig.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, c.c_int

    def call(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(text))
            raise CudaError(name, rc, (text.value or b"?").decode())

    def init(self, ordinal: int = 0) -> int:
        self.call("cuInit", 0)
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        if count.value < 1:
            raise CudaError("cuDeviceGetCount", 100, "CUDA_ERROR_NO_DEVICE")
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self.dev = dev.value
        return count.value

    def attr(self, attr: int) -> int:
        v = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(v), attr, self.dev)
        return v.value

    def info(self) -> dict[str, Any]:
        name = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", name, 256, self.dev)
        total, ver = ctypes.c_size_t(), ctypes.c_int()
        self.call("cuDeviceTotalMem_v2", ctypes.byref(total), self.dev)
        self.call("cuDriverGetVersion", ctypes.byref(ver))
        return {"name": name.value.decode(), "total_bytes": total.value, "cuda_driver_version": ver.value,
                "compute_capability": f"{self.attr(ATTR_CC_MAJOR)}.{self.attr(ATTR_CC_MINOR)}",
                "multiprocessors": self.attr(ATTR_MULTIPROCESSOR_COUNT),
                "can_map_host_memory": bool(self.attr(ATTR_CAN_MAP_HOST_MEMORY))}

    def context(self) -> None:
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.dev)
        self.call("cuCtxSetCurrent", ctx)

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(ptr), nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self.call("cuMemsetD8_v2", ptr, value, nbytes)

    def host_alloc(self, nbytes: int, mapped: bool) -> tuple[int, int | None]:
        """Pinned host memory; with ``mapped`` also its device pointer (for kernels reading over the link)."""
        host = ctypes.c_void_p()
        flags = CU_MEMHOSTALLOC_PORTABLE | (CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0)
        self.call("cuMemHostAlloc", ctypes.byref(host), nbytes, flags)
        dptr = None
        if mapped:
            d = ctypes.c_uint64()
            self.call("cuMemHostGetDevicePointer_v2", ctypes.byref(d), host, 0)
            dptr = d.value
        return int(host.value), dptr

    def free_host(self, host: int) -> None:
        self.call("cuMemFreeHost", ctypes.c_void_p(host))

    def htod(self, dst: int, src: int, nbytes: int) -> None:
        self.call("cuMemcpyHtoD_v2", dst, ctypes.c_void_p(src), nbytes)

    def dtoh(self, dst: int, src: int, nbytes: int) -> None:
        self.call("cuMemcpyDtoH_v2", ctypes.c_void_p(dst), src, nbytes)

    def sync(self) -> None:
        self.call("cuCtxSynchronize")

    def load_kernel(self) -> str:
        """JIT the PTX (first variant the driver takes); returns which one loaded."""
        cc = f"{self.attr(ATTR_CC_MAJOR)}{self.attr(ATTR_CC_MINOR)}"
        errors = []
        for version, target in PTX_VARIANTS:
            target = target.format(cc=cc)
            mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
            try:
                self.call("cuModuleLoadData", ctypes.byref(mod), ptx_text(version, target).encode() + b"\0")
                self.call("cuModuleGetFunction", ctypes.byref(fn), mod, KERNEL_NAME.encode())
            except CudaError as exc:
                errors.append(f"{version}/{target}: {exc.name}")
                continue
            self.kernel = fn
            return f"PTX {version} {target}"
        raise CudaError("cuModuleLoadData", -1, "; ".join(errors))

    def sum64(self, src: int, n_words: int, out: int, grid: int, block: int) -> None:
        args = [ctypes.c_uint64(src), ctypes.c_uint64(n_words), ctypes.c_uint64(out)]
        params = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self.call("cuLaunchKernel", self.kernel, grid, 1, 1, block, 1, 1, 0, None, params, None)


def open_cuda() -> tuple[Cuda, int] | None:
    """The driver and the device count, or None when there is no driver or no device."""
    try:
        cuda = Cuda()
        return cuda, cuda.init(0)
    except (OSError, AttributeError, CudaError):
        return None

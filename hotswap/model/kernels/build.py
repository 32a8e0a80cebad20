"""Builds hotswap's CPU kernels (`csrc/`) once per machine and loads them.

The library is compiled for the instruction set this CPU has, with the C++ compiler torch
itself uses for JIT extensions, into `~/.cache/hotswap/kernels/<name>`, where the name
hashes the source, the flags and the torch version: a later process (or a data-parallel
rank) loads the cached library in milliseconds, and a change to any of them builds anew.
Concurrent builders wait on an flock in that directory, which dies with its holder; a
built library is loaded without torch's build step and its lock file. If no compiler is
available or the build fails, `load_cpu_kernels` says why once and returns None, and the
engine runs on torch's own operators instead (same results up to float rounding).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from hotswap.default_model import cache_root

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
_LOCK = threading.Lock()
_loaded: dict[str, bool] = {}  # library name -> loaded (False: its build failed)


def isa_flags() -> list[str]:
    """Compiler flags for the vector extensions this CPU and torch agree on. at::vec picks
    its implementation from CPU_CAPABILITY, as in torch's own kernels."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        flags = ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]
        if torch.cpu._is_avx512_bf16_supported():
            flags.append("-mavx512bf16")
            if "avx512vbmi" in cpu_flags():  # byte lookups: the FP8 GEMV's decode
                flags.append("-mavx512vbmi")
            if torch.cpu._is_amx_tile_supported():  # AMX tiles come with their bf16 products
                flags += ["-mamx-tile", "-mamx-bf16"]
        return [*flags, "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if capability == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere): for extensions torch
    does not report."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def library_name(flags: list[str]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(SOURCES.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(flags).encode() + torch.__version__.encode())
    return f"hotswap_cpu_{digest.hexdigest()}"


def build_flags() -> list[str]:
    # No FMA contraction: the elementwise kernels round as torch's separate operators do.
    return ["-O3", "-fopenmp", "-ffp-contract=off", *isa_flags()]


def library_dir(name: str | None = None) -> Path:
    """Where the library `name` (default: this machine's build of the kernels) lives."""
    return cache_root() / "kernels" / (name or library_name(build_flags()))


def load_cpu_kernels(progress: bool = True) -> bool:
    """Build (first time on this machine) and load the kernels into this process; their ops
    are then `torch.ops.hotswap_cpu.*`. False if they cannot be built here."""
    flags = build_flags()
    name = library_name(flags)
    with _LOCK:
        if name not in _loaded:
            _loaded[name] = _build_and_load(name, flags, progress)
        return _loaded[name]


def _build_and_load(name: str, flags: list[str], progress: bool) -> bool:
    if hasattr(torch.ops.hotswap_cpu, "gemv"):  # another build of this process loaded
        return True
    directory = library_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}.so"
    if not (library.exists() and _load_built(library)):
        with _builder_lock(directory):
            built = library.exists() and _load_built(library)  # by another process meanwhile
            if not built and not _build(name, flags, directory, progress):
                return False
    _register_fakes()
    return True


def _load_built(library: Path) -> bool:
    """Load a library built earlier (its name hashes sources, flags and torch version),
    without torch's build step, which takes a lock file for every load: a process killed
    inside that step would leave the file behind and every later engine start would wait
    on it forever. False (the file removed) if it cannot be loaded, e.g. a cut-off link."""
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        logger.warning("rebuilding hotswap CPU kernels: %s does not load (%s)", library, e)
        library.unlink(missing_ok=True)
        return False
    return True


@contextmanager
def _builder_lock(directory: Path) -> Iterator[None]:
    """One builder per library on this machine. An flock, which the system releases when
    its holder dies; holding it, torch's own lock file can only be a dead builder's."""
    with open(directory / "builder.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def _build(name: str, flags: list[str], directory: Path, progress: bool) -> bool:
    from torch.utils import cpp_extension

    bar = tqdm(total=1, desc="Building hotswap CPU kernels (once per machine)",
               disable=not progress, leave=False)  # fmt: skip
    try:
        sources = [str(path) for path in sorted(SOURCES.glob("*.cpp"))]
        cpp_extension.load(name, sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(directory), is_python_module=False,
                           verbose=False)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: fall back
        logger.warning("hotswap CPU kernels could not be built (%s); using torch operators "
                       "instead", _first_error(e))  # fmt: skip
        return False
    finally:
        bar.update(1)
        bar.close()
    return True


def _first_error(e: Exception) -> str:
    """The compiler's first error line if there is one, else the exception's last line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "ninja" not in line]
    return (errors or lines or [type(e).__name__])[0 if errors else -1][:300]


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (the ops themselves are opaque to it)."""

    @torch.library.register_fake("hotswap_cpu::paged_decode_attention")
    def _(query, key_cache, value_cache, block_tables, context_lens, scale, k_scale, v_scale):  # noqa: ANN001, ANN202
        return query.new_empty(query.shape)

    @torch.library.register_fake("hotswap_cpu::paged_decode_attention_tiles")
    def _(query, key_tiles, value_tiles, block_tables, context_lens, scale, k_scale, v_scale):  # noqa: ANN001, ANN202
        return query.new_empty(query.shape)

    @torch.library.register_fake("hotswap_cpu::write_kv_tiles")
    def _(key, value, key_tiles, value_tiles, slot_mapping):  # noqa: ANN001, ANN202
        return None

    @torch.library.register_fake("hotswap_cpu::gemv")
    def _(input, weight):  # noqa: ANN001, ANN202, A002
        return input.new_empty(input.shape[0], weight.shape[0])

    @torch.library.register_fake("hotswap_cpu::fp8_gemv")
    def _(input, codes, scale, scale_rows, block_k):  # noqa: ANN001, ANN202, A002
        return input.new_empty(input.shape[0], codes.shape[0])

    @torch.library.register_fake("hotswap_cpu::fp8_dequantize")
    def _(codes, scale, scale_rows, block_k, dtype):  # noqa: ANN001, ANN202
        return codes.new_empty(codes.shape, dtype=dtype)

    @torch.library.register_fake("hotswap_cpu::rms_norm")
    def _(input, weight, eps):  # noqa: ANN001, ANN202, A002
        return input.new_empty(input.shape, dtype=weight.dtype)

    @torch.library.register_fake("hotswap_cpu::add_rms_norm")
    def _(input, residual, weight, eps):  # noqa: ANN001, ANN202, A002
        return input.new_empty(input.shape, dtype=weight.dtype)

    @torch.library.register_fake("hotswap_cpu::rotary_embedding")
    def _(qk, cos, sin):  # noqa: ANN001, ANN202
        return None

    @torch.library.register_fake("hotswap_cpu::amx_linear")
    def _(input, packed, bias):  # noqa: ANN001, ANN202, A002
        return input.new_empty(input.shape[0], packed.shape[0] * 32)

    @torch.library.register_fake("hotswap_cpu::silu_and_mul")
    def _(gate_up):  # noqa: ANN001, ANN202
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("hotswap_cpu::fused_moe")
    def _(x, gate_up, down, ids, weights):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape)

    @torch.library.register_fake("hotswap_cpu::fused_moe_fp8")
    def _(x, gate_up, gate_up_scale, down, down_scale, ids, weights, block_n, block_k):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape)

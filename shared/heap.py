"""Hand the C heap's free pages back to the system once a process is done loading (glibc's ``malloc_trim``).

Loading a model and building an engine allocate and free a few hundred megabytes of intermediates (the
checkpoint's tensors, fused copies, an unquantized weight made into int8 codes); glibc keeps such freed
memory in its heap, so the process's resident size stays at its load-time peak. On SmolLM2 with int8
weights: 937 MB resident after the engine is built, 714 MB after a trim (``bench.quant``'s load child
measures after a trim too). Elsewhere (musl, macOS) there is no such call and nothing to do.
"""

import ctypes
import ctypes.util


def trim() -> bool:
    """Return the heap's free pages to the system; True if glibc released any."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    malloc_trim = getattr(libc, "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))

"""The ggml libraries llama-cpp-python loaded, as ctypes handles: the same mapped copies
libllama uses (:func:`loaded_library`), with the thread-pool functions it does not bind
(:func:`ggml_libs`)."""

from __future__ import annotations

import ctypes
import os

import llama_cpp


class ThreadpoolParams(ctypes.Structure):
    """ggml's ``struct ggml_threadpool_params`` (ggml.h, GGML_MAX_N_THREADS = 512)."""

    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int), ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


_ggml: tuple[ctypes.CDLL, ctypes.CDLL] | None = None


def loaded_library(stem: str) -> str:
    """The file of ``stem`` (``libggml-cpu.so``) that the process has already mapped
    as a dependency of libllama, so that ``ctypes.CDLL`` returns that same library.

    The wheel ships ``libggml-cpu.so``, ``.so.0`` and ``.so.0.25.3`` as separate
    copies of one file, and libllama loads ``.so.0``: opening ``libggml-cpu.so`` by
    name would map a second ggml whose globals ``ggml_cpu_init`` never set up, and
    the thread pool's workers would run that copy's code.
    """
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                name = os.path.basename(path)
                if (path.startswith("/") and (name == stem or name.startswith(stem + "."))
                        and os.path.exists(path)):
                    return path
    except OSError:
        pass
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in (stem + ".0", stem):
        if os.path.exists(os.path.join(libdir, name)):
            return os.path.join(libdir, name)
    return stem


def ggml_libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(libggml-base, libggml-cpu) as llama-cpp-python loaded them, with the
    thread-pool functions it does not bind."""
    global _ggml
    if _ggml is None:
        base = ctypes.CDLL(loaded_library("libggml-base.so"))
        cpu = ctypes.CDLL(loaded_library("libggml-cpu.so"))
        base.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(ThreadpoolParams),
                                                     ctypes.c_int]
        base.ggml_threadpool_params_init.restype = None
        cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
        cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        cpu.ggml_threadpool_free.restype = None
        lib = llama_cpp.llama_cpp._lib
        lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.llama_attach_threadpool.restype = None
        lib.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
        lib.llama_detach_threadpool.restype = None
        _ggml = (base, cpu)
    return _ggml

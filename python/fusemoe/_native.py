"""The native binding, libfusemoe_torch.so (src/torch_binding): fusemoe's ops registered from C++
through PyTorch's stable ABI, whose kernels check the tensors and call the C library with no
Python between torch's dispatcher and the launch.

It is loaded when fusemoe.ops is imported, from the folder of the C library (_capi.library_path():
the copy `pip install --no-build-isolation .` bundles, FUSEMOE_LIBRARY's folder, or build/ of the
checkout), after the C library itself, whose ABI version _capi checks: the binding links
libfusemoe_c.so by name, so it uses that very copy. Without it (built where torch was not
importable, FUSEMOE_NATIVE=0, or it cannot be loaded) fusemoe.ops defines the same ops in Python
over ctypes; status() says which path is in use and why, in one line.

Beside the binding, the autograd formula in C++ (src/torch_binding/autograd.cpp, AUTOGRAD): a
Python module built against one torch release's C++ API and one Python, named after both
(_fusemoe_autograd-torch2.11.0.cpython-312-x86_64-linux-gnu.so), so only the build for the running
pair is looked for; fusemoe.ops' eager calls use it when it is loaded (FUSEMOE_NATIVE_AUTOGRAD=0:
never), else the Python formula. status() names the formula too.

A native op's error reaches Python as PyTorch translates it, which depends on the release (2.11:
ValueError for a bad argument, RuntimeError for the rest; 2.15: RuntimeError for all); the
binding keeps each as its thread's last error with its kind, so fusemoe's entry points re-raise
the class the ctypes path raises: ValueError, FusemoeError, FusemoeOutOfMemoryError (ops._call).
"""
import ctypes
import importlib.machinery
import importlib.util
import os
import warnings

import torch  # noqa: F401  (the binding needs torch's libraries loaded)

from . import _capi

LIBRARY_NAME = "libfusemoe_torch.so"
ERROR_KINDS = {1: "fusemoe", 2: "out of memory", 3: "argument"}  # torch_binding::ErrorKind

LOADED = False
_STATUS = "ctypes: the native binding was not looked for"
_lib = None
# The autograd formula in C++ (src/torch_binding/autograd.cpp), built for one torch release and
# Python: the module when it is loaded (beside the binding, for the running torch), else None and
# fusemoe.ops' Python formula runs.
AUTOGRAD = None
_AUTOGRAD_STATUS = "Python formula: the C++ one was not looked for"


def library_path():
    """Where the binding is looked for: beside the C library that _capi loads."""
    return os.path.join(os.path.dirname(_capi.library_path()), LIBRARY_NAME)


def _load():
    """Loads the binding if it can; returns (loaded, one-line status)."""
    global _lib
    if os.environ.get("FUSEMOE_NATIVE") == "0":
        return False, "ctypes: FUSEMOE_NATIVE=0"
    path = library_path()
    if not os.path.isfile(path):
        return False, (f"ctypes: {LIBRARY_NAME} not built (looked at {path}); build the package where "
                       "torch is importable: pip install --no-build-isolation .")
    try:
        _capi.load()
    except _capi.FusemoeError as e:
        return False, f"ctypes: the C library is not loadable, so neither is the binding: {e}"
    try:
        torch.ops.load_library(path)
        lib = ctypes.CDLL(path)
        lib.fusemoe_torch_last_error.argtypes = [ctypes.POINTER(ctypes.c_int32)]
        lib.fusemoe_torch_last_error.restype = ctypes.c_char_p
        lib.fusemoe_torch_report_devices.argtypes = []
        lib.fusemoe_torch_report_devices.restype = ctypes.c_uint64
        lib.fusemoe_torch_take_reported_error.argtypes = []
        lib.fusemoe_torch_take_reported_error.restype = ctypes.c_char_p
    except (OSError, AttributeError) as e:
        status = f"ctypes: cannot load {path}: {e}"
        warnings.warn(f"fusemoe: {status}", RuntimeWarning, stacklevel=3)
        return False, status
    _lib = lib
    return True, f"native: {path} (PyTorch stable ABI, torch {torch.__version__})"


def _autograd_module_path():
    """The C++ autograd module built for the running torch release and Python, beside the binding."""
    release = torch.__version__.split("+")[0]
    name = f"_fusemoe_autograd-torch{release}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    return os.path.join(os.path.dirname(library_path()), name)


def _load_autograd():
    """Loads the C++ autograd module if the binding is loaded and a build for this torch is there;
    returns (module or None, what the status line says of it)."""
    if not LOADED:
        return None, "Python formula"
    if os.environ.get("FUSEMOE_NATIVE_AUTOGRAD") == "0":
        return None, "Python formula: FUSEMOE_NATIVE_AUTOGRAD=0"
    path = _autograd_module_path()
    if not os.path.isfile(path):
        return None, (f"Python formula: no C++ module for torch {torch.__version__} (looked at "
                      f"{path}; it is built against the torch the build found)")
    try:
        spec = importlib.util.spec_from_file_location("_fusemoe_autograd", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        status = f"Python formula: cannot load {path}: {e}"
        warnings.warn(f"fusemoe: {status}", RuntimeWarning, stacklevel=3)
        return None, status
    return module, f"C++ ({path})"


def init_autograd(error_classes):
    """Gives the C++ autograd module the binding's last-error function and the Python class of each
    error kind (fusemoe.ops' _NATIVE_ERROR_CLASSES), so its errors are raised as ops._call raises
    them, also from inside backward()."""
    if AUTOGRAD is not None:
        address = ctypes.cast(_lib.fusemoe_torch_last_error, ctypes.c_void_p).value
        AUTOGRAD.init(address, error_classes[1], error_classes[2], error_classes[3])


def status():
    """One line: "native: <path> ...; autograd: <which formula>" when the ops are the binding's,
    else "ctypes: <why>"."""
    return _STATUS if not LOADED else f"{_STATUS}; autograd: {_AUTOGRAD_STATUS}"


def last_error():
    """(kind, message) of the binding's last error on this thread: kind is a key of ERROR_KINDS,
    or 0 (message "") if none."""
    kind = ctypes.c_int32()
    message = _lib.fusemoe_torch_last_error(ctypes.byref(kind))
    return kind.value, message.decode("utf-8", "replace")


def report_devices():
    """Indices of the devices that have expert-id reports (native calls made on them)."""
    mask = _lib.fusemoe_torch_report_devices() if LOADED else 0
    return [index for index in range(64) if mask >> index & 1]


def take_reported_error():
    """The message of a bad expert id reported by an earlier native call (that report is then
    cleared), or None."""
    if not LOADED:
        return None
    message = _lib.fusemoe_torch_take_reported_error()
    return None if message is None else message.decode("utf-8", "replace")


LOADED, _STATUS = _load()
AUTOGRAD, _AUTOGRAD_STATUS = _load_autograd()

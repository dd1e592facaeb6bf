"""Triton's interpreter (``TRITON_INTERPRET=1``, the suite's Triton kernels on CPU) without its
repeated patching inside a launch.

A launch patches the ``triton.language`` modules its kernel's globals name with the interpreter's
implementations, and restores them after. Triton 3.9's interpreter patches them again on every
call of a ``@triton.jit`` device function inside the kernel: a pass of ``inspect.getmembers`` over
the language modules that changes nothing once the modules the function names are patched, and took
a third of an attention kernel's interpreted time. Such calls skip it here. A function that names a
module the launch did not patch (Triton's own ``tl.zeros`` names ``triton.language.core``) patches
it as before, on its first call in the launch (the interpreter never restores that patch). The
kernels compute the same bits either way (checked on every conformance case of both Triton
kernels), and the conformance suites compare them with the reference.
"""

import inspect
from typing import Set

import triton.language as tl
from triton.runtime import interpreter


def _languages(fn) -> Set[int]:
    """Ids of the ``triton.language`` modules ``fn``'s globals name (what ``_patch_lang`` patches)."""
    return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}


def skip_repatching_in_launches() -> None:
    """Device-function calls that name only modules the running launch patched run without
    patching them again."""
    launch, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    patched: Set[int] = set()  # the running launch's language modules

    def launch_recording_its_languages(self, *args, **kwargs):
        patched.update(_languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    def call_in_launch(self, *args, **kwargs):
        languages = _languages(self.fn)
        if not patched:  # outside a launch
            return device_call(self, *args, **kwargs)
        if not languages <= patched:  # the call patches them for the rest of the launch (never restored)
            patched.update(languages)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch_recording_its_languages
    interpreter.InterpretedFunction.__call__ = call_in_launch

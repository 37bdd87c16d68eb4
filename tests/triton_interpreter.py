"""Triton 3.6's interpreter, made to compute what compiled kernels compute (conftest applies it
where there is no GPU, before any test imports attnkit's Triton kernels)."""

from __future__ import annotations


def apply() -> None:
    """Three bugs of Triton 3.6's interpreter that compiled kernels do not have, patched here, and
    one slowness:

    * a runtime loop bound becomes ``int(array)`` of a one-element 1-D array, which NumPy 2.4
      refuses, so any ``range(runtime_value)`` fails (triton-lang/triton#9171, fixed by #9172 after
      3.6): the upstream fix;
    * ``tl.dot`` multiplies bfloat16 operands as their raw uint16 storage: they are widened to
      float32 first (exact: bf16 products are exact in fp32, as on tensor cores);
    * ``x.to(tl.bfloat16)`` truncates float32 where compiled code rounds to nearest even: it
      rounds (truncation doubles the error of the rounded weights in the backward);
    * every call of a ``@triton.jit`` helper patches ``triton.language`` again (~3 ms) although the
      kernel's launch has patched it already: the helpers of ``attnkit._backends.triton``, whose
      modules use only ``tl`` (patched by the launch), are called straight away; others still patch.

    Each applies only where the interpreter has the attribute it replaces."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "attnkit_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.attnkit_fixed = True
    interpreter._patch_lang_tensor = patched

    dot = getattr(interpreter.InterpreterBuilder, "create_dot", None)
    if dot is None or not hasattr(interpreter, "_convert_float"):
        return

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot

    convert = interpreter._convert_float

    def convert_rounding(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype != tl.bfloat16:
            return convert(data, input_dtype, output_dtype, rounding_mode)
        # round to nearest even on the bits (a carry may run into the exponent, up to inf)
        bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        quiet_nan = ((bits >> 16) | 0x40).astype(np.uint16)
        return np.where(np.isnan(np.asarray(data, dtype=np.float32)), quiet_nan, rounded)

    interpreter._convert_float = convert_rounding

    patching_call = interpreter.InterpretedFunction.__call__

    def call_helper(self, *args, **kwargs):
        if not self.fn.__module__.startswith("attnkit._backends.triton."):
            return patching_call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as error:
            raise interpreter.InterpreterError(repr(error)) from error

    interpreter.InterpretedFunction.__call__ = call_helper

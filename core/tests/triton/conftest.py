import numpy as np

# TRITON_INTERPRET=1 on machines without a GPU is set by the repository's root conftest.py


def _round_float32_to_bfloat16_like_gpus() -> bool:
    """Make the interpreter round float32 -> bfloat16 to nearest even, as GPUs do; True once patched.

    Triton's CPU interpreter truncates that conversion (``.to(tl.bfloat16)`` and stores into
    bfloat16 tensors), where NVIDIA, AMD and Intel GPUs round to nearest even. Truncation doubles
    a kernel's mean error and biases it, so the error statistics of ``Op.check`` would measure the
    interpreter instead of the kernel. Only the default rounding is changed; an explicit
    ``fp_downcast_rounding="rtz"`` still truncates.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    convert = getattr(interpreter, "_convert_float", None)
    if convert is None or getattr(convert, "rounds_to_nearest", False):
        return convert is not None
    rtz = interpreter._ir.ROUNDING_MODE.RTZ

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode != rtz:
            bits = np.ascontiguousarray(np.asarray(data, dtype=np.float32)).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = (bits & 0x7FFFFFFF) > 0x7F800000  # keep NaN a NaN (the carry could make it inf)
            return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)
        return convert(data, input_dtype, output_dtype, rounding_mode)

    convert_float.rounds_to_nearest = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert_float
    return True


INTERPRETER_ROUNDS_LIKE_GPUS = _round_float32_to_bfloat16_like_gpus()

"""4/8-bit weight-only (W4A16, W8A16) layers shared by the awq, gptq and compressed-tensors plugins.

- ``layout``: the logical ``IntWeight`` every format unpacks to, the packed ``KernelWeight`` the
  kernels read, and the torch reference (``wna16_linear_torch``, the CPU path).
- ``kernels``: the Triton dequantize-GEMV/GEMM (imports triton; loaded on first CUDA call).
- ``method``: ``WNA16LinearMethod``, the base of the formats' linear methods.
- ``rtn``: a round-to-nearest quantizer for tests and benchmarks.

A library, not a plugin: it registers nothing. Importing this package imports nothing heavy.
"""

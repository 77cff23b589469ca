"""Linear layers on GGUF-quantized weights, served as the file stores them
(issue 31): the block types (ggml_types), their dequantization in torch
(dequant, the reference and the fallback) and the matmul that runs on the
blocks themselves (matmul: the native op model_proc/native/quant.cpp for
decode, row tiles dequantized on the fly for prefill), with no float copy of
a weight kept."""

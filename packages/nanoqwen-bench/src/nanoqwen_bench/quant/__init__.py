"""Quantizer measurements: the 7B GPTQ pack on a GPU (`gptq_7b_h200`, with the calibration tokens in
prepared/), the 7B RTN pack on the CPU (`rtn_7b_cpu`) and the 0.5B quality table (`quality_05b`)."""

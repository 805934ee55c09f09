# One device call (session 26): is torch.pow(2, n) exact on this GPU; the int8 GEMV builds' GPU tests;
# then the engine with gemv_build int8 / int8-staged within the reference bound (test_engine_gpu.py).
SRC=$(ls -d "$PWD"/packages/*/src | paste -sd:)
PYTHONPATH=$SRC python3 -c "
import torch
n = torch.arange(-126, 120, device='cuda').double()
print('torch.pow(2, n) exact on the GPU:', torch.equal(torch.pow(2.0, n).cpu(), torch.pow(2.0, n.cpu())))"
PYTHONPATH=$SRC timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
  packages/nanoqwen-kernels/tests/test_gemv_int8_mma.py 2>&1 | tee $OUT/int8-gpu-tests.log | tail -4
PYTHONPATH=$SRC timeout ${ENGINE_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -k int8 \
  packages/nanoqwen-runtime/tests/test_engine_gpu.py 2>&1 | tee $OUT/int8-engine-tests.log | tail -4

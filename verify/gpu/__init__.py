"""``python -m verify gpu`` (``make gpu-check``): one command that checks the CUDA path and writes its whole
report into a folder, to be read afterwards.

    PYTHONPATH=. python3 -m verify gpu --out DIR                # on a GPU machine, with its own python3
    python -m verify gpu --out DIR --device cpu --quick         # the dry run: every step on CPU, tiny sizes

Steps, each in its own process under its own deadline (a step that fails, hangs or dies is reported and the
next one runs); the whole check stays under 8 minutes:

    env        the machine: torch, CUDA, the GPU, enabled SDPA backends, whether flash-attn is installed
    matrix     the verifier's CP 1 matrix on the device in float32 (TF32 off), bfloat16, float16: both
               kernels, every doc-id source; per dtype the largest errors, the tolerance entry applied and
               the SDPA backends the baseline and the implementation ran
    multirank  CP 2 and 4 with the device's tensors, ranks sharing one GPU over gloo: which collectives
               carry such tensors (probed), then the verifier's cases whose exchange can run
    kernels    varlen vs dense vs torch SDPA per document, fwd+bwd, bfloat16, H=32, Hkv=8, D=128, long-tail
               documents at S = 32k and 128k: useful TFLOP/s against the bfloat16 matmul rate measured in
               the same run, peak device memory

Writes DIR/report.json (everything), DIR/summary.txt (a page), DIR/logs/<step>.log. Exit status 0 iff the
verdict is pass. The CUDA branches are taken only when ``torch.cuda.is_available()`` (or ``--device cuda``).
Imports torch, numpy and the project only.
"""

from .harness import DEADLINES, TOTAL_S, add_arguments, main, run_check
from .step import STEPS

__all__ = ["DEADLINES", "STEPS", "TOTAL_S", "add_arguments", "main", "run_check"]

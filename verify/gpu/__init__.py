"""``python -m verify gpu`` (``make gpu-check``): one command that checks the CUDA path and writes its whole
report into a folder, to be read afterwards.

    PYTHONPATH=. python3 -m verify gpu --out DIR                # on a GPU machine, with its own python3
    python -m verify gpu --out DIR --device cpu --quick         # the dry run: every step on CPU, tiny sizes

Steps, each in its own process under its own deadline (a step that fails, hangs or dies is reported and the
next one runs; one that runs out of time keeps what it judged and leaves the verdict incomplete, not failed);
the whole check stays under 8 minutes. Every expected result is computed on the device under test:

    env        the machine: torch, CUDA, the GPU, enabled SDPA backends, flash-attn / fla / triton, and whether
               the varlen kernel calls flash-attn at head dims 64, 128, 256, 264 (or why not); whether topk keeps
               the same keys among equal scores for a row whatever the call's other rows (DSA under CP)
    matrix     CP 1 attention on the device in float32 (TF32 off), bfloat16, float16: head dims 64 and 128
               first (fused masked backends, flash-attn), then the verifier's CP 1 matrix (head dims 3-5); per
               dtype the largest errors, the tolerance entry, the SDPA backends of baseline and implementation,
               fully masked rows handed to SDPA (none expected), flash-attn calls
    mixers     CP 1 Gated DeltaNet (through fla when installed, TRITON_F32_DEFAULT=ieee), Mamba2, convolution
    multirank  CP 2 and 4, ranks sharing one GPU with every collective staged through host memory over gloo
               (verify.gpu.staging): probes, then flash-attn's path with a padding-only rank, the mixers, the
               attention cases over every kernel x exchange x layout
    kernels    varlen vs dense vs torch SDPA per document, fwd+bwd, bfloat16, H=32, Hkv=8, D=128, long-tail
               documents at S = 32k and 128k: useful TFLOP/s against the bfloat16 matmul rate measured in
               the same run, peak device memory

Beside the steps, on CUDA with fla installed: ``warm`` runs step mixers' fla cases from the check's start, so that
fla's Triton kernels are compiled (and cached on disk) before the steps call them; stopped before ``kernels``.

The dry run (``--device cpu``) runs the same code with flash-attn and fla replaced by their strict emulations
(:mod:`verify.gpu.emulate`).

Writes DIR/report.json (everything), DIR/summary.txt (a page), DIR/logs/<step>.log. Exit status 0 iff the
verdict is pass. The CUDA branches are taken only when ``torch.cuda.is_available()`` (or ``--device cuda``).
Imports torch, numpy and the project only.
"""

from .harness import DEADLINES, TOTAL_S, add_arguments, main, run_check
from .step import STEPS

__all__ = ["DEADLINES", "STEPS", "TOTAL_S", "add_arguments", "main", "run_check"]

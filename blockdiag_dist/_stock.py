"""torch's own SDPA, bound once, so that kernels keep calling it while a routing helper has rebound
``torch.nn.functional.scaled_dot_product_attention`` to ``cp_blockdiag_sdpa``."""

import torch
import torch.nn.functional as F

stock_sdpa = getattr(torch._C._nn, "scaled_dot_product_attention", F.scaled_dot_product_attention)

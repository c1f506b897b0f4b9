"""Implementations with planted bugs, for proving that the verifier catches them.

``verify.mutants.toy`` is a small, correct CP attention with the seed's API (contiguous shards, all-gather,
dense per-document mask): ``python -m verify --impl verify.mutants.toy`` passes. Each other module is the
same code with one bug that CP systems are known to ship:

| module             | bug                                                                     | verifier reports |
| ------------------ | ----------------------------------------------------------------------- | ---------------- |
| `off_by_one`       | the causal mask lets each query see one future key                      | fail             |
| `no_grad_reduce`   | backward of the all-gather keeps the local slice, no sum over ranks     | fail             |
| `leak_across_docs` | causal over the whole row: packed documents see each other              | fail             |
| `nonzero_padding`  | padding rows are not zeroed                                             | fail             |
| `short_straddle`   | the previous rank's last key never arrives                              | fail             |
| `skip_collective`  | rank 1 never enters the all-gather                                      | timeout          |
| `raise_forward`    | rank 1 raises inside the forward                                        | error            |
| `raise_backward`   | rank 1 raises inside the backward                                       | error            |
| `kill_rank`        | rank 1 is killed (SIGKILL) inside the forward                           | crash            |
| `kv_scale`         | K and V arrive scaled by 1 + 1e-4 (float64: 1 + 1e-9), at every CP size | fail             |
| `refuse_rows`      | refuses B > 1 with a ValueError on every rank                           | error            |
| `docs_by_id`       | a document is every token sharing an id (declared in its CONVENTIONS)   | fail             |
| `late_layer`       | from a step's second attention call on, a query sees one future key     | pass (one call)  |
| `sinks_ignored`    | the sinks never join the softmax denominator (``s_aux`` dropped)        | fail             |
| `chunk_from_row`   | chunk boundaries counted from the row's start, not each document's      | fail             |
| `softcap_after_softmax` | ``softcap * tanh(.)`` applied to the probabilities, not the scores | fail             |
| `temperature_from_row` | the NoPE temperature from the query's row position, not its document's (Llama 4 as shipped) | fail |
| `block_cut_at_rank_edge` | a bidirectional block (an image) sees only its later keys on the query's own rank: cut at the rank edge | fail (CP >= 2) |

The mixers of hybrid models (``--layer conv`` / ``gated_delta`` / ``mamba2`` / ``kda`` / ``sparse`` / ``mamba1`` /
``lightning`` cases; ``verify.mutants._mixers``, the bugs planted by each family of ``verify.families``):
blockdiag_dist itself with one mistake in its convolution, its recurrences (the recurrence bugs are planted in the
gated delta rule, Mamba2's SSD, KDA, Mamba1's selective scan and lightning attention) or its sparse attention's
indexer.

| module                     | bug                                                                  | verifier reports |
| -------------------------- | -------------------------------------------------------------------- | ---------------- |
| `mixer_state_leak`         | the recurrence runs over each row's real tokens: state leaks across documents | fail     |
| `mixer_reset_late`         | a document's state is reset one token late                            | fail             |
| `mixer_summary_bf16`       | continuing documents' summaries exchanged and folded in bfloat16      | fail (float32)   |
| `mixer_conv_unmasked`      | the convolution's history is not masked by document                   | fail             |
| `mixer_history_wrong_rank` | the history is the previous rank's last rows (right only for contiguous shards of long pieces) | fail |
| `mixer_ssd_no_decay`       | the SSD's fold drops the transitions (a state crossing a piece held elsewhere is not decayed) | fail |
| `mixer_decay_per_rank`     | KDA's and lightning attention's decay counted from the rank's first row: a continuing piece's entering state decays too much | fail |
| `mixer_topk_over_row`      | DeepSeek Sparse Attention's indexer picks its top-k among the row's earlier tokens, not the document's (NeMo Automodel's packed path) | fail |
| `mixer_expand_unused`      | DeepSeek Sparse Attention's rank of padding only expands the keys it received outside the graph: right in the sum over the ranks, no gradient for the expansion's weights on that rank | fail |
| `mixer_scan_decay_per_rank` | the selective scan's entering state decayed by every token the rank holds before the piece in its row (per rank, not per document) | fail |

Classed by ``verify.classify`` (as third-party code is): ``off_by_one``, ``no_grad_reduce``,
``leak_across_docs``, ``nonzero_padding``, ``short_straddle``, ``kv_scale`` and the four variant bugs
(``sinks_ignored``, ``chunk_from_row``, ``softcap_after_softmax``, ``temperature_from_row``, on cases with the
variant; ``block_cut_at_rank_edge`` where a block crosses a rank edge) are bugs, ``skip_collective`` a hang,
``raise_forward``, ``raise_backward``, ``kill_rank`` crashes, ``refuse_rows`` unsupported, ``docs_by_id`` a
contract (a pass once re-checked with its declared document definition). ``late_layer`` is wrong only in a model's
later layers: the attention verifier (one call per step) passes it, ``python -m verify model`` names the layer.

``verify.mutants.minimal.<name>`` (``toy`` and every module above) is the same code behind an adapter declaring
minimal support: one kernel, one exchange, ``_packed_seq_ids`` only, our conventions otherwise. The matrix's
covering must find every bug through it with ``--quick`` too (``python -m verify --impl
verify.mutants.minimal.docs_by_id --quick`` fails on reused ids).
"""

from ._toy import BUGS

__all__ = ["BUGS"]

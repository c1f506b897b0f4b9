"""verify.model — judge a whole model's training step under CP against each document run alone.

Main entries: ``python -m verify model`` (:mod:`verify.model.cli`, docs/verify-model.md); for tests,
:func:`~verify.model.harness.document_reference` (the truth: every document alone through the same model on one
device, stock attention, the same weights), :func:`~verify.model.harness.cp_step` (the step under CP through an
implementation) and :func:`~verify.model.harness.compare` (loss and every parameter's gradient, grouped by module
kind). Around them: :mod:`~verify.model.zoo` (which model, the presets), :mod:`~verify.model.tiny` (shrinking a
config, every layer type kept), :mod:`~verify.model.layouts` and :mod:`~verify.model.multimodal` (packed
batches), :mod:`~verify.model.record` (every module's output, to name the first wrong one),
:mod:`~verify.model.precision` (what a model computes below float64), :mod:`~verify.model.reference` (the truth and the baselines), :mod:`~verify.model.check` (one case,
classed) and :mod:`~verify.model.run` (cases over persistent pools).

Nothing here imports transformers until a model is resolved.
"""

from .harness import Comparison, StepResult, compare, cp_step, document_reference, module_kind, packed_reference

__all__ = ["Comparison", "StepResult", "compare", "cp_step", "document_reference", "module_kind", "packed_reference"]

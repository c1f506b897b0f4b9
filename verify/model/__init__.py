"""verify.model — judge a whole model's training step under CP against each document run alone.

Main entries: :func:`~verify.model.harness.document_reference` (the truth: every document alone through the same
model on one device, stock attention, the same weights), :func:`~verify.model.harness.cp_step` (the step under CP
through an implementation) and :func:`~verify.model.harness.compare` (loss and every parameter's gradient,
grouped by module kind, the first wrong module named).
"""

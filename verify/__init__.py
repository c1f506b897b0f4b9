"""verify — proves a CP attention implementation equal to the float64 reference.

Main entry: ``python -m verify`` (``make verify``): the case matrix over persistent gloo pools. Also
``python -m verify case ...`` (replay one case), ``python -m verify fuzz`` (hypothesis) and
``python -m verify plan`` (the exchange-plan inspector) and ``python -m verify gpu`` (the GPU check).
"""

"""Predictions before launch: what each rank of a layout will hold, keep for backward, compute
and communicate in a training step, for any model.

    trace.py        a rank's step run on fake tensors in a fake world: activation bytes, FLOPs,
                    collectives, measured on the model itself
"""

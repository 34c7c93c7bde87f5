"""A stand-in for ``torch.ops.lfmspark`` that records the calls of one op (model tests).

Monkeypatched over a module's ``lfm`` (models/layers.py calls its fused ops through it), it returns
every op unchanged except ``name``, whose calls run as usual and append their positional arguments
to :attr:`OpCalls.calls`: the tests count them and read flags among them.
"""

from __future__ import annotations

import torch


class OpCalls:
    def __init__(self, name: str):
        self.name = name
        self.calls: list[tuple] = []

    def __getattr__(self, attr: str):
        op = getattr(torch.ops.lfmspark, attr)
        if attr != self.name:
            return op

        def recorded(*args, **kwargs):
            self.calls.append(args)
            return op(*args, **kwargs)
        return recorded

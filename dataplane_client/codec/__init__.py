"""Tensors to and from the wire form: the columnar jagged codec, TensorDicts, devices,
the assembly of a read. Torch, no Ray."""
